#!/usr/bin/env bash
# Tear down the cluster started by scripts/slurm_up.sh: cancel every job, stop the daemons named in
# their pidfiles, undo slurm_up.sh's /etc/hosts line, wipe the state. Run as root.
#   SLURM_WIPE=0   keep /var/spool/slurm* state
#   STOP_MUNGE=0   leave munged running (e.g. a systemd-managed one)
set -uo pipefail
T0=$(date +%s.%N)
log() { printf '[slurm_down %6.2fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }

# shellcheck source=scripts/slurm_lib.sh
. "$(dirname "$0")/slurm_lib.sh"

cancel_jobs
stop_pidfile /run/slurm/slurmd.pid slurmd
stop_pidfile /run/slurm/slurmctld.pid slurmctld
[ "${STOP_MUNGE:-1}" = 1 ] && stop_pidfile /run/munge/munged.pid munged

unmark_hosts slurm_up.sh

if [ "${SLURM_WIPE:-1}" = 1 ]; then
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
fi
log "slurm down"
