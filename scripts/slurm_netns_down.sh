#!/usr/bin/env bash
# Tear down the cluster started by scripts/slurm_netns_up.sh: cancel every job, stop each node's slurmd (its pid
# file), then slurmctld and munged and the state (scripts/slurm_down.sh), then the node namespaces, their veths,
# the bridge and the /etc/hosts lines slurm_netns_up.sh added. Safe to run when nothing (or half) is up. Root.
set -uo pipefail
T0=$(date +%s.%N)
log() { printf '[slurm_netns_down %6.2fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }
HERE=$(cd "$(dirname "$0")" && pwd)

# shellcheck source=scripts/slurm_lib.sh
. "$HERE/slurm_lib.sh"

cancel_jobs  # first, so slurmstepd kills the steps (Monarch workers and their procs) inside the namespaces
for pf in /run/slurm/slurmd-cmnode*.pid; do
  [ -s "$pf" ] && stop_pidfile "$pf" "$(basename "$pf" .pid)"
done

bash "$HERE/slurm_down.sh"   # slurmctld, munged, spool state
rm -rf /var/spool/slurmd/cmnode*

# Every process still in a node namespace is a leftover of this cluster (the namespaces are ours alone).
for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^cmn[0-9]+$/ {print $1}'); do
  pids=$(ip netns pids "$ns" 2>/dev/null)
  if [ -n "$pids" ]; then
    kill -KILL $pids 2>/dev/null
    log "killed leftover processes in $ns: $(echo $pids)"
  fi
  ip netns del "$ns"
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{sub(/@.*/, "", $2); print $2}' | grep -E '^cmv[0-9]+$'); do
  ip link del "$link"
done
ip link show cmbr0 >/dev/null 2>&1 && ip link del cmbr0
log "namespaces, veths and bridge removed"

unmark_hosts slurm_netns_up.sh
log "slurm netns cluster down"
