"""`ip netns exec` is recognised from /proc/self/mountinfo (its /sys is a sysfs named after the
namespace), never from a file that cannot be read (/proc/1/ns/mnt is unreadable on fresh machines)."""
from dataplane.loader import _sysfs_source, under_ip_netns_exec

HOST = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
"""
IP_NETNS_EXEC = """\
45 44 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
47 45 0:21 / /proc rw,relatime - proc proc rw
48 45 0:39 / /sys rw,relatime - sysfs blue rw
"""


def test_sysfs_source_is_read_from_mountinfo():
    assert _sysfs_source(HOST) == "sysfs"
    assert _sysfs_source(IP_NETNS_EXEC) == "blue"
    assert _sysfs_source("27 1 254:0 / / rw - ext4 /dev/vda rw\n") is None


def test_the_machines_own_mount_namespace_is_not_taken_for_ip_netns_exec():
    assert not under_ip_netns_exec(HOST, ["blue", "red"])
    assert not under_ip_netns_exec(HOST, [])


def test_ip_netns_exec_is_recognised_by_its_sysfs():
    assert under_ip_netns_exec(IP_NETNS_EXEC, ["blue", "red"])
    assert not under_ip_netns_exec(IP_NETNS_EXEC, ["red"])  # a sysfs named after no namespace


def test_a_later_mount_over_sys_wins():
    covered = IP_NETNS_EXEC + "50 48 0:40 / /sys rw - tmpfs tmpfs rw\n"
    assert _sysfs_source(covered) is None
