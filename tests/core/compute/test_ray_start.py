"""An embedded Ray that misses Ray's fixed 30 s node start-up on a busy machine gets another start
(prx_core.compute.quiet.start_ray); any other failure, or a cluster address, fails at once."""

from __future__ import annotations

import pytest
import ray

from prx_core.compute import quiet

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


def fake_init(failures: list[Exception]):
    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        if failures:
            raise failures.pop(0)

    return init, calls


def test_a_start_up_timeout_is_retried(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    init, calls = fake_init([TIMEOUT, TIMEOUT])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    quiet.start_ray()
    assert len(calls) == 3 and calls[-1]["include_dashboard"] is False
    assert "attempt 2 of 3, the machine is busy" in capsys.readouterr().err


@pytest.mark.parametrize("failures, address", [([TIMEOUT] * 3, None), ([RuntimeError("no GPU")], None),
                                               ([TIMEOUT], "ray://head:10001")])
def test_other_failures_and_a_third_timeout_raise(monkeypatch: pytest.MonkeyPatch, failures: list, address) -> None:
    init, calls = fake_init(list(failures))
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(Exception) as raised:
        quiet.start_ray(address)
    assert raised.value is failures[-1] and len(calls) == len(failures)
