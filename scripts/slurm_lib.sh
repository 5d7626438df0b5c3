# Shared by the cluster scripts (slurm_up.sh / slurm_down.sh: one node; slurm_netns_up.sh / slurm_netns_down.sh:
# nodes in namespaces), sourced after they define `log`: munged, the node-independent part of slurm.conf,
# slurmctld; and for teardown, stopping daemons, cancelling jobs and removing marked /etc/hosts lines. Not a
# script of its own.

# Start munged unless it already answers (SLURM_AUTH=munge), and set AUTH_LINES for slurm.conf either way.
start_munge() {
  if [ "$SLURM_AUTH" = munge ]; then
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge
    if [ ! -s /etc/munge/munge.key ]; then
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
      chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    fi
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
      runuser -u munge -- /usr/sbin/munged --force
      for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    fi
    munge -n | unmunge >/dev/null
    log "munged up"
    AUTH_LINES="AuthType=auth/munge
CredType=cred/munge"
  else
    AUTH_LINES="AuthType=auth/none
CredType=cred/none"
  fi
}

# The slurm.conf lines that do not depend on the nodes. No cgroup plugins: they are what breaks in containers
# and without systemd.
slurm_conf_common() {
  cat <<'CONF'
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerParameters=batch_sched_delay=0,sched_interval=1
MessageTimeout=10
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
MailProg=/bin/true
CONF
}

# slurmctld from a clean state (-c), once it answers pings.
start_slurmctld() {
  /usr/sbin/slurmctld -c
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
  scontrol ping | grep -q UP || { tail -50 /var/log/slurm/slurmctld.log >&2; exit 1; }
  log "slurmctld up"
}

# ---------------------------------------------------------------- teardown
alive() {  # running and not a zombie (daemons double-fork; a lazy PID 1 leaves <defunct> entries)
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

stop_pidfile() {  # <pidfile> <name>: TERM, then KILL after 15 s; the pidfile removed
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

# Cancel every job while slurmctld is up, so slurmstepd kills the job steps and the processes they started.
cancel_jobs() {
  if [ -s /run/slurm/slurmctld.pid ] && alive "$(cat /run/slurm/slurmctld.pid)"; then
    scancel --quiet --user=root 2>/dev/null || true
    for _ in $(seq 100); do
      squeue -h -t PD,CF,R,S,CG -o %i 2>/dev/null | grep -q . || break; sleep 0.1
    done
    log "jobs cancelled"
  fi
}

unmark_hosts() {  # <script name>: remove the /etc/hosts lines it added (marked "# added by <script name>")
  local mark="# added by $1\$"
  if grep -q "$mark" /etc/hosts 2>/dev/null; then
    local tmp
    tmp=$(mktemp); grep -v "$mark" /etc/hosts > "$tmp"; cat "$tmp" > /etc/hosts; rm -f "$tmp"
    log "removed $1 lines from /etc/hosts"
  fi
}
