#!/usr/bin/env bash
# Mount the BPF filesystem on /sys/fs/bpf unless it is mounted already (idempotent; an existing
# mount is left alone). A fresh machine of this kind boots without it; the dataplane pins there.
set -eu
if grep -qs ' /sys/fs/bpf bpf ' /proc/mounts; then exit 0; fi
echo "setup: mounting the BPF filesystem on /sys/fs/bpf"
mount -t bpf bpf /sys/fs/bpf || { echo "setup: cannot mount bpffs on /sys/fs/bpf (a kernel without CONFIG_BPF_SYSCALL?)" >&2; exit 1; }
