"""dosa.net.multicast_group: when a job's results go to a group (once per packet) and when
they fall back to unicast fan-out; both ends derive it from the job alone."""
import pytest

from dosa.job import JobConfig
from dosa.net import multicast_group


def _job(hosts, job_id=258):
    return JobConfig(job_id=job_id, numel=1000, hosts=hosts, dpus=[("10.0.0.200", 17791)])


@pytest.mark.timeout(10)
def test_group_derived_from_job_id_on_the_hosts_port(monkeypatch):
    monkeypatch.delenv("DOSA_MULTICAST", raising=False)
    j = _job([("10.0.0.10", 17791), ("10.0.0.11", 17791)])
    assert multicast_group(j) == ("239.77.1.2", 17791)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("hosts", [
    [("10.0.0.10", 17791), ("10.0.0.11", 17792)],   # ports differ: one datagram cannot reach both
    [("127.0.0.1", 17791), ("127.0.0.1", 17792)],   # loopback
    [("10.0.0.10", 17791), ("10.0.0.10", 17791)],   # not distinct
    [("10.0.0.10", 17791)],                          # one host: nothing to replicate
])
def test_unicast_where_multicast_cannot_work(monkeypatch, hosts):
    monkeypatch.delenv("DOSA_MULTICAST", raising=False)
    assert multicast_group(_job(hosts)) is None


@pytest.mark.timeout(10)
def test_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("DOSA_MULTICAST", "0")
    assert multicast_group(_job([("10.0.0.10", 17791), ("10.0.0.11", 17791)])) is None
