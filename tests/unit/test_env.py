"""dosa.env.RankEnv, the one parser of a rank's DOSA_* environment: what the testbed, the deploy and
torchrun write is what hosts read back, and a malformed value is one sentence."""
import pytest

from dosa.env import RankEnv, switch_on
from dosa.errors import DosaError


def test_what_to_env_writes_parse_reads_back():
    e = RankEnv(rank=3, world_size=4, job_id=7, host_addr="10.77.0.13", iface="eth0", port=17791,
                dpu_addrs=["10.77.0.200", "10.77.0.201"], control=("10.77.0.200", 17800),
                secret_file="/run/dosa/dosa/credentials/host.secret", control_ca="/etc/dosa/ca.crt")
    env = e.to_env()
    assert env["DOSA_DPU_ADDRS"] == "10.77.0.200,10.77.0.201" and env["DOSA_CONTROL_PORT"] == "17800"
    assert env["DOSA_SECRET_FILE"].endswith("host.secret") and env["DOSA_CONTROL_CA"] == "/etc/dosa/ca.crt"
    assert RankEnv.parse(env) == e


def test_an_environment_for_torchrun_leaves_rank_to_it_and_parse_defaults_to_rank_0():
    env = RankEnv(rank=None, host_addr="10.0.0.1").to_env()
    assert "RANK" not in env
    assert RankEnv.parse(env).rank == 0


def test_control_needs_both_address_and_port_and_empty_values_are_unset():
    assert RankEnv.parse({"DOSA_CONTROL_ADDR": "10.0.0.1"}).control is None
    assert RankEnv.parse({"DOSA_PORT": "", "DOSA_JOB_CONFIG": "", "DOSA_SECRET_FILE": "",
                          "DOSA_CONTROL_CA": ""}) == RankEnv()


def test_a_malformed_integer_is_one_sentence():
    with pytest.raises(DosaError, match="DOSA_CONTROL_PORT must be an integer, got 'x'"):
        RankEnv.parse({"DOSA_CONTROL_ADDR": "10.0.0.1", "DOSA_CONTROL_PORT": "x"})


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False), (" No ", False)])
def test_switches_are_on_unless_turned_off(value, on):
    assert switch_on("DOSA_MULTICAST", {} if value is None else {"DOSA_MULTICAST": value}) is on
