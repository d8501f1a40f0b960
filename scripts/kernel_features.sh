#!/usr/bin/env bash
# Check (and where they are modules, load) the kernel features dosa needs. Idempotent; prints one
# sentence per missing feature and exits 1 if any is missing. Used by scripts/setup.sh.
set -u
# the features, one a line:  CONFIG option, module name (- when never a module), what needs it
FEATURES="
BPF_SYSCALL       -           BPF maps, programs and pins (dataplane)
XDP_SOCKETS       xsk         AF_XDP sockets (optional transport)
NET_NS            -           network namespaces (testbed)
VETH              veth        veth pairs (testbed links)
BRIDGE            bridge      the fabric bridge (testbed)
NET_SCH_TBF       sch_tbf     link rate shaping (testbed --link-rate)
NET_SCH_HTB       sch_htb     link rate shaping on DPU links (testbed)
NET_SCH_FIFO      -           the pfifo towards each DPU (testbed)
NET_SCH_INGRESS   sch_ingress clsact hooks for the impairment program (testbed --loss/--dup/--reorder)
NET_CLS_BPF       cls_bpf     the tc BPF impairment program (testbed --loss/--dup/--reorder)
"
OPTIONAL="XDP_SOCKETS"
config=""
if [ -r /proc/config.gz ]; then config=$(zcat /proc/config.gz 2>/dev/null)
elif [ -r "/boot/config-$(uname -r)" ]; then config=$(cat "/boot/config-$(uname -r)"); fi
missing=0
while read -r opt mod what; do
    [ -n "$opt" ] || continue
    if [ -n "$config" ]; then
        val=$(printf '%s\n' "$config" | sed -n "s/^CONFIG_${opt}=\(.*\)/\1/p")
    else
        val=unknown  # no kernel config to read: try the module, trust the features' own errors later
    fi
    case "$val" in
        y) ;;
        m|unknown)
            if [ "$mod" != - ] && command -v modprobe >/dev/null 2>&1; then modprobe -q "$mod" 2>/dev/null || true; fi
            if [ "$val" = m ] && [ "$mod" != - ] && [ -d /sys/module ] && [ ! -d "/sys/module/$mod" ]; then
                echo "setup: kernel feature CONFIG_$opt is a module ($mod) that could not be loaded: needed for $what"
                case " $OPTIONAL " in *" $opt "*) ;; *) missing=1 ;; esac
            fi ;;
        *)
            echo "setup: this kernel lacks CONFIG_$opt, needed for $what"
            case " $OPTIONAL " in *" $opt "*) ;; *) missing=1 ;; esac ;;
    esac
done <<< "$FEATURES"
exit $missing
