#!/usr/bin/env bash
# A single-node SLURM cluster on this machine (localhost), to try `hydra/launcher=slurm_cpu`
# on a laptop; tests/test_slurm.py runs the sweeps of docs/clusters.md against it.
#
#   sudo scripts/slurm/start_cluster.sh [STATE_DIR]     # default /tmp/bench-slurm
#   export SLURM_CONF=STATE_DIR/etc/slurm.conf          # then sbatch/squeue/sacct/python -m bench use it
#   sudo scripts/slurm/stop_cluster.sh [STATE_DIR]      # stops exactly the daemons started here
#
# What runs: munged (unless one already answers), mariadbd + slurmdbd (accounting, so that
# `sacct`, which submitit polls, knows finished and cancelled jobs), slurmctld and slurmd. Each
# runs in the foreground of its own session, its PID in STATE_DIR/pids/, its log in
# STATE_DIR/log/. Everything else (config, spool, database) lives in STATE_DIR too, and the
# ports are not SLURM's defaults (BENCH_SLURM_PORT, default 16817..16820: slurmctld, slurmd,
# slurmdbd, mariadb), so a real SLURM or MariaDB on the machine is left alone.
# Root is needed: slurmd starts jobs as their users, and missing packages are installed with
# apt-get (Debian/Ubuntu: slurm-wlm slurmdbd munge mariadb-server).
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0;; esac  # the header above is the manual
set -Eeuo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # the daemons live there; a non-login root shell may lack it

STATE=${1:-/tmp/bench-slurm}
PORT=${BENCH_SLURM_PORT:-16817}
CLUSTER=benchlocal
HERE=$(cd "$(dirname "$0")" && pwd)

die() { echo "start_cluster: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (sudo): slurmd starts jobs as their users, and packages may need installing"
case "$PORT" in ''|*[!0-9]*) die "BENCH_SLURM_PORT must be a port number, got '$PORT'";; esac

# --- packages -------------------------------------------------------------------------------
missing() { for c in munged munge unmunge slurmctld slurmd slurmdbd sbatch sacct sacctmgr mariadbd mariadb-install-db mariadb-admin mariadb; do
              command -v "$c" >/dev/null || { echo "$c"; return; }; done; }
if [ -n "$(missing)" ]; then
    command -v apt-get >/dev/null || die "$(missing) not found and no apt-get here: install SLURM (slurmctld, slurmd, slurmdbd), munge and MariaDB"
    echo "start_cluster: installing slurm-wlm slurmdbd munge mariadb-server with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends slurm-wlm slurmdbd munge mariadb-server mariadb-client >&2 \
        || die "apt-get install slurm-wlm slurmdbd munge mariadb-server mariadb-client failed"
    [ -z "$(missing)" ] || die "$(missing) still not found after apt-get install"
fi

# --- state directory ------------------------------------------------------------------------
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)
for f in "$STATE"/pids/*; do
    [ -e "$f" ] || continue
    kill -0 "$(cat "$f")" 2>/dev/null && die "a cluster already runs from $STATE ($(basename "$f") pid $(cat "$f")); stop it first: $HERE/stop_cluster.sh $STATE"
    rm -f "$f"
done
mkdir -p "$STATE"/{pids,log,etc,run,spool/ctld,spool/d}
export SLURM_CONF=$STATE/etc/slurm.conf

# From here on, a failure (or Ctrl-C) stops what was started.
started_ok=
on_exit() {
    [ -n "$started_ok" ] && return
    echo "start_cluster: failed; stopping what was started (logs: $STATE/log)" >&2
    "$HERE/stop_cluster.sh" "$STATE" >&2 || true
}
trap on_exit EXIT

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in $PORT $((PORT + 1)) $((PORT + 2)) $((PORT + 3)); do
    port_free "$p" || die "port $p is in use; choose other ports with BENCH_SLURM_PORT=<first of four free ports>"
done

# start NAME CMD...: runs CMD in its own session (detached from this shell's terminal), output to
# log/NAME.log, and records its PID. setsid execs without forking here (a background job of a
# non-interactive shell is not a process group leader), so $! is the daemon's own PID.
start() {
    local name=$1; shift
    setsid "$@" >"$STATE/log/$name.log" 2>&1 </dev/null &
    echo $! >"$STATE/pids/$name"
}
# wait_for WHAT SECONDS CMD...: polls CMD until it succeeds.
wait_for() {
    local what=$1 seconds=$2; shift 2
    for _ in $(seq $((seconds * 2))); do
        alive "$what" || break  # it exited: no use waiting
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "start_cluster: $what did not come up in ${seconds}s; its log:" >&2
    tail -n 20 "$STATE/log/$what.log" >&2 2>/dev/null || true
    return 1
}
alive() { [ ! -e "$STATE/pids/$1" ] || kill -0 "$(cat "$STATE/pids/$1")" 2>/dev/null; }
# The stop script kills by these PIDs: make sure each is the daemon itself.
check_pid() { [ "$(cat "/proc/$(cat "$STATE/pids/$1")/comm" 2>/dev/null)" = "$1" ] \
                  || die "the PID recorded for $1 is not $1's; stop by hand and report this"; }

# --- munge: the authentication every SLURM message carries ----------------------------------
munge_ok() { munge -n | unmunge >/dev/null; }
if munge_ok 2>/dev/null; then
    echo "start_cluster: a munged already answers; using it (stop_cluster.sh leaves it running)" >&2
else
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    # munged refuses a socket directory others can write to; clients (slurmd, job steps of every
    # user) must be able to traverse it: 0755.
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    start munged setpriv --reuid=munge --regid=munge --clear-groups munged --foreground
    wait_for munged 15 munge_ok
fi

# --- accounting: mariadb + slurmdbd ----------------------------------------------------------
DBPASS_FILE=$STATE/etc/db.pass
[ -s "$DBPASS_FILE" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DBPASS_FILE")
DBPASS=$(cat "$DBPASS_FILE")
if [ ! -d "$STATE/mysql/mysql" ]; then
    # Throwaway database in the state dir, run as root (the state dir may sit under a directory
    # only root can enter) and reachable only on 127.0.0.1.
    mariadb-install-db --no-defaults --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
        --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || { tail -n 20 "$STATE/log/mariadb-install.log" >&2; false; }
fi
start mariadbd mariadbd --no-defaults --user=root --datadir="$STATE/mysql" --socket="$STATE/run/mysqld.sock" \
    --port=$((PORT + 3)) --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$STATE/run/mariadbd.pid" \
    --innodb-buffer-pool-size=32M
wait_for mariadbd 60 timeout 10 mariadb-admin --no-defaults --socket="$STATE/run/mysqld.sock" ping
mariadb --no-defaults --socket="$STATE/run/mysqld.sock" -u root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL

HOST=$(hostname -s)
# nproc alone honours OMP_NUM_THREADS (the test suite sets 1): the node gets the CPUs this process may run on
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)  # leave 10% to the OS

# slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF; it must be 0600 (a password).
(umask 077; cat >"$STATE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
PidFile=$STATE/run/slurmdbd.pid
EOF
)

cat >"$SLURM_CONF" <<EOF
# Single-node test cluster written by scripts/slurm/start_cluster.sh; state in $STATE.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
# No cgroups needed (containers, laptops): processes tracked by parent PID, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# CPUs are what jobs consume; memory is checked against the node but not reserved.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
# Seconds between the SIGTERM of scancel (or of the time limit) and the SIGKILL: SLURM's default.
KillWait=30
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

start slurmdbd slurmdbd -D
wait_for slurmdbd 60 timeout 10 sacctmgr -n list cluster
# slurmctld records jobs only for a cluster the database knows.
sacctmgr -n list cluster format=cluster | grep -qw "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null

# --- the scheduler and the node ----------------------------------------------------------------
start slurmctld slurmctld -D
wait_for slurmctld 60 timeout 10 sinfo -h
start slurmd slurmd -D
node_idle() { timeout 10 sinfo -h -n "$HOST" -o %T | grep -qx "idle"; }
wait_for slurmd 60 node_idle

for f in "$STATE"/pids/*; do check_pid "$(basename "$f")"; done
started_ok=1
cat <<EOF
SLURM runs on $HOST: $CPUS CPUs, ${MEM_MB} MB, partition 'local', accounting in slurmdbd.
  export SLURM_CONF=$SLURM_CONF
  PIDs: $(for f in "$STATE"/pids/*; do printf '%s=%s ' "$(basename "$f")" "$(cat "$f")"; done)
  logs: $STATE/log/
  stop: $HERE/stop_cluster.sh $STATE
EOF
