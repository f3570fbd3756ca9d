"""A submission's text shown on a terminal (``prism_challenge.terminal``): control sequences and
bidirectional overrides come out as visible escapes, at the origin (findings, failures, the
audit's words) and in ``prism check``'s table."""
import json

from prism_challenge.cli import main
from prism_challenge.failures import EvalFailure
from prism_challenge.gates.findings import Finding
from prism_challenge.terminal import printable, shown

CLEAR_GREEN = "\x1b[2J\x1b[32mPASSED"


def test_printable_escapes_controls_and_bidi_marks_and_keeps_tab_newline_and_text():
    assert printable("a\tb\nc") == "a\tb\nc"
    assert printable(CLEAR_GREEN) == "\\x1b[2J\\x1b[32mPASSED"
    assert printable("\x00\x07\x7f\x9b") == "\\x00\\x07\\x7f\\x9b"
    assert printable("if x\u202e\u2066 else \u200f") == "if x\\u202e\\u2066 else \\u200f"
    assert printable("é ü 中文 ∑") == "é ü 中文 ∑"  # text, not controls
    assert printable("a\u200bb\u2028c\ufeffd\ud800") == "a\\u200bb\\u2028c\\ufeffd\\ud800"  # invisible, unencodable
    assert shown("[bold]x\x1b") == "\\[bold]x\\x1b"


def test_findings_and_failures_keep_the_text_but_not_the_controls():
    f = Finding("prism:build-error", "architecture.py", 3, 0, f"build_model(ctx): ValueError: {CLEAR_GREEN}")
    assert f.message == "build_model(ctx): ValueError: \\x1b[2J\\x1b[32mPASSED"
    e = EvalFailure("contract", f"the loop raised {CLEAR_GREEN}", f"line 1\n\x1b]0;owned\x07")
    assert (e.message, e.detail) == ("the loop raised \\x1b[2J\\x1b[32mPASSED", "line 1\n\\x1b]0;owned\\x07")
    assert str(e) == "contract: the loop raised \\x1b[2J\\x1b[32mPASSED"


def test_prism_check_shows_an_exceptions_escape_codes_as_text(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    root = tmp_path / "b"
    root.mkdir()
    (root / "architecture.py").write_text(f"def build_model(ctx):\n    raise ValueError({CLEAR_GREEN!r})\n")
    (root / "training.py").write_text("def train(ctx):\n    pass\n")
    assert main(["check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "ValueError: \\x1b[2J\\x1b[32mPASSED" in out
    assert main(["check", str(root), "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    (finding,) = [f for f in findings if f["rule"] == "prism:build-error"]  # the others: advisories
    assert finding["message"] == "build_model(ctx): ValueError: \\x1b[2J\\x1b[32mPASSED"


class _OneReplyJail:
    """A jail stand-in whose child ended with exit status 0 and wrote ``stdout``."""

    hidden = ()

    def __init__(self, stdout: bytes):
        self.stdout = stdout

    def run(self, argv, **kw):
        from prism_challenge.evaluator.jailchild import Finished

        return Finished(0, self.stdout, b"", False, None, None)


def test_a_childs_reply_too_long_or_too_deep_for_json_is_a_crash_not_a_traceback(tmp_path):
    """A child that ran submitted code owns its stdout: a number of 5,000 digits (``ValueError``,
    not a ``JSONDecodeError``) or 100,000 nested lists (``RecursionError``) must end as the
    child's failure, named, not as the parent's traceback."""
    import pytest

    from prism_challenge.audit.rescore import AuditError, _reply
    from prism_challenge.gates.param_parent import measure_parameters

    for stdout in [b"1" * 5000, b"[" * 100_000 + b"]" * 100_000]:
        got = measure_parameters(tmp_path, "architecture", "build_model", vocab_size=8, seq_len=8,
                                 max_parameters=10, jail=_OneReplyJail(stdout))
        assert (got.count, got.kind) == (None, "crash") and got.error.startswith("the child ended without a result")
        from prism_challenge.evaluator.jailchild import Finished

        with pytest.raises(AuditError, match="crash: no result in the rescore process") as caught:
            _reply(Finished(0, stdout, b"", False, None, None), "rescore")
        assert caught.value.by_submission


def test_prism_check_shows_prism_yamls_tokenizer_as_text(tmp_path, capsys, monkeypatch):
    """Red team rt19b: ``prism.yaml``'s tokenizer reached the header raw (a screen clear, a Rich
    ``[link]`` and a right-to-left override)."""
    monkeypatch.setenv("COLUMNS", "250")
    root = tmp_path / "b"
    root.mkdir()
    (root / "architecture.py").write_text("def build_model(ctx):\n    raise ValueError('x')\n")
    (root / "training.py").write_text("def train(ctx):\n    pass\n")
    (root / "prism.yaml").write_text('tokenizer: "gpt2\\e[2J[link=https://evil.example]click[/link]\\u202eevil"\n')
    main(["check", str(root)])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert "tokenizer gpt2\\x1b[2J[link=https://evil.example]click[/link]\\u202eevil" in out
