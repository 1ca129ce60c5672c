#!/usr/bin/env bash
# Stops the cluster scripts/slurm/start_cluster.sh started from STATE_DIR (default /tmp/bench-slurm):
# first its jobs (scancel, so no task outlives its slurmd), then exactly the daemons whose PIDs
# it recorded in STATE_DIR/pids/, newest first: SIGTERM, then SIGKILL after 20 s. A munged that
# was already running before start_cluster.sh has no PID file and is left alone.
#
#   sudo scripts/slurm/stop_cluster.sh [STATE_DIR]
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0;; esac  # the header above is the manual
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin

STATE=${1:-/tmp/bench-slurm}
[ -d "$STATE/pids" ] || { echo "stop_cluster: nothing started from $STATE (no $STATE/pids)" >&2; exit 0; }
export SLURM_CONF=$STATE/etc/slurm.conf

running() {  # running NAME: the recorded PID is alive (not a zombie) and still that daemon (not a reused PID)
    local pid
    pid=$(cat "$STATE/pids/$1" 2>/dev/null) || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && ! grep -q '^State:.Z' "/proc/$pid/status" 2>/dev/null
}

if running slurmctld; then
    jobs=$(timeout 10 squeue -h -o %F | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        echo "stop_cluster: cancelling jobs $jobs" >&2
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs
        for _ in $(seq 80); do [ -z "$(timeout 10 squeue -h -o %i)" ] && break; sleep 0.5; done
        left=$(timeout 10 squeue -h -o %i | tr '\n' ' ')
        [ -z "${left// /}" ] || echo "stop_cluster: jobs still listed after 40 s: $left" >&2
    fi
fi

status=0
for name in slurmd slurmctld slurmdbd mariadbd munged; do
    [ -e "$STATE/pids/$name" ] || continue
    pid=$(cat "$STATE/pids/$name")
    if ! running "$name"; then
        echo "stop_cluster: $name (pid $pid) had already exited" >&2
    else
        kill -TERM "$pid"
        for _ in $(seq 40); do running "$name" || break; sleep 0.5; done
        if running "$name"; then
            echo "stop_cluster: $name (pid $pid) ignored SIGTERM for 20 s; SIGKILL" >&2
            kill -KILL "$pid"
            sleep 0.5
        fi
        echo "stop_cluster: stopped $name (pid $pid)" >&2
    fi
    if running "$name"; then
        echo "stop_cluster: $name (pid $pid) is still running" >&2
        status=1
    else
        rm -f "$STATE/pids/$name"
    fi
done
exit $status
