"""Research: what a researcher reads and makes around runs.

* :mod:`~prism_challenge.research.compare` and :mod:`~prism_challenge.research.compare_report`:
  ``prism compare`` and its HTML report;
* :mod:`~prism_challenge.research.plots`: the learning curves;
* :mod:`~prism_challenge.research.report`: a run's console summary;
* :mod:`~prism_challenge.research.scaffold`: ``prism init``'s template bundle.
"""
