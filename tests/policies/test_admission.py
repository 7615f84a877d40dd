import pytest

from kvstore.errors import ConfigError
from kvstore.policies.admission import AIMDAdmission, AIMDConfig


def test_aimd_backs_off_on_collapse_and_recovers():
    a = AIMDAdmission(AIMDConfig(initial=4, window=4, target=0.6))
    assert all(a.admit(t) for t in range(4))
    assert not a.admit(99) and a.rejected == 1
    assert a.admit(0)                               # an admitted task always is
    for _ in range(4):
        a.on_request_done(0, 0.2)                   # middle-phase thrashing
    assert a.limit == 2.0
    a.finish(0), a.finish(1), a.finish(2)
    assert a.admit("new") and a.active == 2 and not a.admit("more")
    for _ in range(8):
        a.on_request_done("new", 0.9)
    assert a.limit == 4.0
    assert a.admit("more")


def test_aimd_validation_and_ignores_unknown_tasks():
    a = AIMDAdmission(AIMDConfig(initial=2, window=1))
    a.on_request_done("ghost", 0.0)
    assert a.limit == 2.0
    with pytest.raises(ConfigError):
        a.on_request_done("ghost", 1.5)
    with pytest.raises(ConfigError):
        AIMDConfig(initial=0)
