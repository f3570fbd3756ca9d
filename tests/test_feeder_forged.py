"""Frames a hostile rank forges must fail the run as the submission's (or be charged), never as a
trusted-side fault: the feeder's reader reads any other exception as stage ``data``, kind
``infrastructure``, which the service retries on a fresh secret seed (a free re-roll)."""

import math

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.failures import REPORTED, kind_of

from test_feeder import FakeRunner, make_feeder, wait_done


def _kind(res) -> str:
    err = res.error
    return kind_of(err["stage"], REPORTED if err.get("origin") == "runner" else err.get("cause") or "")


def test_a_loss_record_of_an_integer_past_floats_range_is_charged_as_non_finite(tmp_path):
    f = make_feeder(tmp_path, step_budget=2)
    r = FakeRunner(f)
    r.next(4, 10)
    r.record(0, 10**400)  # valid JSON (401 digits); float() of it raises OverflowError
    r.next(4, 10)
    r.record(1, 5.0)
    assert r.next(4, 10) is None
    protocol.send(r.sock, Kind.DONE, {})
    assert wait_done(f)
    res = f.finish()
    assert res.error is None and res.nonfinite_batches == 1
    assert res.steps[0].nats == 2 * math.log(257) * 36 and res.steps[1].nats == 5.0  # 2 ln V per target


def test_a_negative_integer_past_floats_range_is_a_negative_code_length(tmp_path):
    f = make_feeder(tmp_path)
    r = FakeRunner(f)
    r.next(4, 10)
    r.record(0, -(10**400))
    assert f.failed.wait(5)
    res = f.finish()
    assert res.error["stage"] == "runner" and "negative code length" in res.error["message"]
    assert _kind(res) == "submission"


def test_a_state_digest_that_is_not_a_string_is_a_disagreement_not_a_data_fault(tmp_path):
    f = make_feeder(tmp_path, world_size=2, step_budget=1)
    r0, r1 = FakeRunner(f, 0), FakeRunner(f, 1)
    r0.next(3, 5), r1.next(3, 5)
    r0.record(0, 1.0), r1.record(0, 2.0)
    assert r0.next(3, 5) is None and r1.next(3, 5) is None
    protocol.send(r0.sock, Kind.DONE, {"state_sha256": "a" * 64})
    protocol.send(r1.sock, Kind.DONE, {"state_sha256": ["a" * 64]})  # unhashable
    assert f.failed.wait(5)
    res = f.finish()
    assert res.error["stage"] == "consistency" and "rank(s) [1] disagree with rank 0" in res.error["message"]
    assert _kind(res) == "submission"


def test_state_frames_with_a_list_dtype_or_a_true_dimension_are_the_ranks_protocol_error(tmp_path):
    for header in ({"name": "w", "dtype": ["torch.float32"], "shape": [1]},
                   {"name": "w", "dtype": "torch.float32", "shape": [True]}):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        f = make_feeder(d)
        r = FakeRunner(f)
        protocol.send(r.sock, Kind.STATE, header, bytes(4))
        assert f.failed.wait(5)
        res = f.finish()
        assert res.error["stage"] == "runner" and "malformed state frame header" in res.error["message"], res.error
        assert _kind(res) == "submission"


def test_a_request_for_an_infinite_batch_is_the_ranks_protocol_error(tmp_path):
    f = make_feeder(tmp_path)
    r = FakeRunner(f)
    protocol.send(r.sock, Kind.NEXT, {"batch_size": math.inf, "seq_len": 10})  # JSON Infinity: int() overflows
    assert f.failed.wait(5)
    res = f.finish()
    assert res.error["stage"] == "runner" and "NEXT needs integer batch_size and seq_len" in res.error["message"]
    assert _kind(res) == "submission"


def test_a_forged_done_header_keeps_the_manifests_types_and_an_honest_one_is_kept_whole(tmp_path):
    from prism_challenge.evaluator.donereport import clean_done
    from prism_challenge.evaluator.gpu import peak_memory
    from prism_challenge.manifest.results import ModelInfo

    honest = {**peak_memory(), "device_name": "cpu (x86_64)", "phases": {"staging": 0.5, "batches": 3},
              "parameter_count": 1234, "state_sha256": "0f" * 32, "state_tensors": {"w": "ab" * 32},
              "state_moments": {"w": [1.0, 2.0, 3.0, 4.0]}}
    assert clean_done(honest) == honest
    forged = {"peak_rss_bytes": -1, "peak_device_bytes": True, "device_name": ["x"], "parameter_count": [1],
              "state_sha256": "not hex", "phases": [1], "state_tensors": "x", "extra": {"a": 1}}
    f = make_feeder(tmp_path)
    r = FakeRunner(f)
    r.next(4, 10)
    r.record(0, 1.0)
    protocol.send(r.sock, Kind.EVENT, {"event": "left", "batches": 1})
    protocol.send(r.sock, Kind.DONE, forged)
    assert wait_done(f)
    done = f.finish().done[0]
    assert done == {"peak_rss_bytes": None, "peak_device_bytes": None, "device_name": None, "parameter_count": None,
                    "state_sha256": None, "phases": None, "state_tensors": None}
    # what the manifest's model then accepts (it refused "not hex": an exception out of evaluate())
    ModelInfo.model_validate({"parameter_count": done["parameter_count"], "state_sha256": done["state_sha256"],
                              "state_sha256_per_rank": {"0": done["state_sha256"]}, "state_path": None})
