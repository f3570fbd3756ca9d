"""The isolated run: launcher (trusted) -> runner + instrument (untrusted, per rank) <-> feeder.

Modules: ``interface`` (PrismContext, the submission's only API), ``seeding`` (forced init),
``instrument`` (the prequential loss of a batch), ``protocol`` (the socket framing),
``feeder`` (trusted: builds batches, records losses), ``warm`` (rank processes started early,
claimed by torchrun's workers), ``single`` (one rank without torchrun: its worker environment
and exit status), ``rank`` (torchrun's entry point) and
``runner`` (untrusted: imports the bundle and calls ``train(ctx)``), ``launcher`` (trusted:
starts torchrun, or the single-rank agent).
"""
