"""The manifest: a run's self-describing record, its signature, and the checks anyone can run on it.

* :mod:`~prism_challenge.manifest.results`: the typed result and the manifest's JSON schema;
* :mod:`~prism_challenge.manifest.fields`, :mod:`~prism_challenge.manifest.run_sections` and
  :mod:`~prism_challenge.manifest.score_sections`: the manifest's section models (re-exported by
  ``results``);
* :mod:`~prism_challenge.manifest.record`: the manifest as the pipeline builds it, and signs it;
* :mod:`~prism_challenge.manifest.run_manifest`: the run directory's manifest file;
* :mod:`~prism_challenge.manifest.certificate`: Ed25519 signatures over the manifest;
* :mod:`~prism_challenge.manifest.verify` and its parts (``verify_recompute``, ``verify_audit``,
  ``verify_reexecute``): ``prism verify``;
* :mod:`~prism_challenge.manifest.runs_prune`: ``prism runs prune``.
"""
