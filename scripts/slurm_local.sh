#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine: munged, slurmctld and slurmd on localhost, one
# partition "debug" holding this node (its CPUs and memory as `slurmd -C` reports them). For tests
# and for trying `python -m arealite.launcher.slurm` without a cluster. Idempotent; needs root and
# Debian's slurm-wlm + munge (`apt-get install -y slurm-wlm munge`). `scripts/slurm_local.sh stop`
# stops the daemons.
set -euo pipefail
if [ "${1:-}" = stop ]; then
  pkill -x slurmd || true; pkill -x slurmctld || true; pkill -x munged || true
  exit 0
fi
for bin in slurmctld slurmd munged sinfo; do
  command -v "$bin" >/dev/null || { echo "slurm_local: $bin not found; apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "slurm_local: needs root (it writes /etc/slurm and starts daemons)" >&2; exit 1; }

mkdir -p /etc/slurm /etc/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
if id munge >/dev/null 2>&1; then
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
fi
chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
  if id munge >/dev/null 2>&1; then su -s /bin/sh munge -c munged; else munged --force; fi
fi

NODE_LINE=$(slurmd -C | head -n 1)            # NodeName=<host> CPUs=... RealMemory=...
HOST=$(echo "$NODE_LINE" | sed -E 's/^NodeName=([^ ]+).*/\1/')
CONF=/etc/slurm/slurm.conf
NEW=$(cat <<CONFEOF
# Written by arealite scripts/slurm_local.sh: a one-node cluster on this machine.
ClusterName=arealite
SlurmctldHost=$HOST
AuthType=auth/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=5
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
$NODE_LINE State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONFEOF
)
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW" ]; then
  echo "$NEW" > "$CONF"
  pkill -x slurmd || true; pkill -x slurmctld || true; sleep 1
fi
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
  state=$(sinfo -h -o %T 2>/dev/null | head -n 1 || true)
  case "$state" in idle|mixed|allocated) echo "slurm_local: node $HOST is $state"; exit 0 ;; esac
  scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm_local: the node did not become idle; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
exit 1
