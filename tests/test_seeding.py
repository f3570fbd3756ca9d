"""Forced determinism and source-only imports, each checked in a fresh interpreter."""

import subprocess
import sys
import textwrap


def run_python(code: str, cwd=None) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_force_determinism_sets_the_torch_flag_and_inductor_default_without_importing_inductor():
    got = run_python("""
        import sys, torch
        from prism_challenge.evaluator.seeding import force_determinism
        force_determinism(7, 2)
        before = "torch._inductor.config" in sys.modules
        import torch._inductor.config as cfg
        print(torch.are_deterministic_algorithms_enabled(), before, cfg.deterministic, torch.get_num_threads())
    """)
    assert got == "True False True 2"


def test_bundle_modules_compile_from_source_only(tmp_path):
    import importlib.util
    import py_compile

    (tmp_path / "mod.py").write_text("VALUE = 'source'\n")
    (tmp_path / "hidden.py").write_text("VALUE = 'planted'\n")
    py_compile.compile(str(tmp_path / "hidden.py"), cfile=importlib.util.cache_from_source(str(tmp_path / "mod.py")),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH, doraise=True)
    plain = run_python("import sys; sys.path.insert(0, '.'); import mod; print(mod.VALUE)", cwd=tmp_path)
    guarded = run_python("""
        import sys
        from prism_challenge.evaluator.seeding import force_source_imports
        force_source_imports('.')
        sys.path.insert(0, '.')
        import mod, json
        print(mod.VALUE, json.__name__)
    """, cwd=tmp_path)
    assert plain == "planted" and guarded == "source json"
