"""Score and verdict: what a run's records are worth.

* :mod:`~prism_challenge.score.scoring`: prequential bits-per-byte, the stream's code length;
* :mod:`~prism_challenge.score.scoringprecision`: which autocast the scoring forwards run under;
* :mod:`~prism_challenge.score.verdict`: the flags, the penalties and the final score;
* :mod:`~prism_challenge.score.gapnoise`: the memorization gap's noise, measured in each run;
* :mod:`~prism_challenge.score.crown`: the ranking rule (one-sided Welch test, short runs);
* :mod:`~prism_challenge.score.flops`: the compute a run spent, beside its score.
"""
