#!/usr/bin/env bash
# Tear down the cluster started by scripts/slurm_up.sh: cancel every job, stop the daemons named in
# their pidfiles, undo slurm_up.sh's /etc/hosts line, wipe the state. Run as root.
#   SLURM_WIPE=0   keep /var/spool/slurm* state
#   STOP_MUNGE=0   leave munged running (e.g. a systemd-managed one)
set -uo pipefail
T0=$(date +%s.%N)
log() { printf '[slurm_down %6.2fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }

alive() {  # running and not a zombie (daemons double-fork; a lazy PID 1 leaves <defunct> entries)
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

stop_pidfile() {  # <pidfile> <name>
  local pf=$1 name=$2 pid
  [ -s "$pf" ] || return 0
  pid=$(cat "$pf")
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 150); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then echo "$name ($pid) ignored TERM for 15s, sending KILL"; kill -KILL "$pid"; fi
  fi
  rm -f "$pf"
  log "$name stopped"
}

# Cancel everything first so slurmstepd kills the job steps and the processes they started.
if [ -s /run/slurm/slurmctld.pid ] && alive "$(cat /run/slurm/slurmctld.pid)"; then
  scancel --quiet --user=root 2>/dev/null || true
  for _ in $(seq 100); do
    squeue -h -t PD,CF,R,S,CG -o %i 2>/dev/null | grep -q . || break; sleep 0.1
  done
  log "jobs cancelled"
fi

stop_pidfile /run/slurm/slurmd.pid slurmd
stop_pidfile /run/slurm/slurmctld.pid slurmctld
[ "${STOP_MUNGE:-1}" = 1 ] && stop_pidfile /run/munge/munged.pid munged

if grep -q '# added by slurm_up.sh$' /etc/hosts 2>/dev/null; then
  tmp=$(mktemp); grep -v '# added by slurm_up.sh$' /etc/hosts > "$tmp"; cat "$tmp" > /etc/hosts; rm -f "$tmp"
  log "removed slurm_up.sh lines from /etc/hosts"
fi

if [ "${SLURM_WIPE:-1}" = 1 ]; then
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
fi
log "slurm down"
