"""Child for tests/test_audit.py: import a bundle module, arm the audit hook, run one function.

``python tests/audit_driver.py BUNDLE_DIR ARTIFACTS_DIR MODULE FUNCTION ARG...``; prints the
function's result as JSON on the last line when the hook lets it finish.
"""
import importlib
import json
import sys

import torch  # noqa: F401  (the harness's own imports come before the hook, as in a rank)

from prism_challenge.evaluator.audit import arm


def main() -> None:
    bundle, artifacts, module, function, *args = sys.argv[1:]
    sys.path.insert(0, bundle)
    mod = importlib.import_module(module)
    arm(bundle, [artifacts])
    result = getattr(mod, function)(*args)
    print(json.dumps({"result": result}))


if __name__ == "__main__":
    main()
