#!/usr/bin/env bash
# Tear down the cluster started by scripts/slurm_netns_up.sh: cancel every job, stop each node's slurmd (its pid
# file), then slurmctld and munged and the state (scripts/slurm_down.sh), then the node namespaces, their veths,
# the bridge and the /etc/hosts lines slurm_netns_up.sh added. Safe to run when nothing (or half) is up. Root.
set -uo pipefail
T0=$(date +%s.%N)
log() { printf '[slurm_netns_down %6.2fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }
HERE=$(cd "$(dirname "$0")" && pwd)

alive() {  # running and not a zombie
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

# Jobs first, so slurmstepd kills the steps (Monarch workers and their procs) inside the namespaces.
if [ -s /run/slurm/slurmctld.pid ] && alive "$(cat /run/slurm/slurmctld.pid)"; then
  scancel --quiet --user=root 2>/dev/null || true
  for _ in $(seq 100); do
    squeue -h -t PD,CF,R,S,CG -o %i 2>/dev/null | grep -q . || break; sleep 0.1
  done
  log "jobs cancelled"
fi

for pf in /run/slurm/slurmd-cmnode*.pid; do
  [ -s "$pf" ] || continue
  pid=$(cat "$pf")
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 150); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && { echo "slurmd ($pid) ignored TERM for 15s, sending KILL"; kill -KILL "$pid"; }
  fi
  rm -f "$pf"
  log "stopped $(basename "$pf" .pid)"
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

if grep -q '# added by slurm_netns_up.sh$' /etc/hosts 2>/dev/null; then
  tmp=$(mktemp); grep -v '# added by slurm_netns_up.sh$' /etc/hosts > "$tmp"; cat "$tmp" > /etc/hosts; rm -f "$tmp"
  log "removed slurm_netns_up.sh lines from /etc/hosts"
fi
log "slurm netns cluster down"
