# Shared by the prolog and the epilog (sourced, not run): settings, logging and the GPU -> job map.
#
# The map is dcgm-exporter's --hpc-job-mapping-dir format: a file per GPU, named by the GPU's index, holding the
# ids of the jobs on that GPU, one a line (several where GPUs are shared). Slurm gives the job's GPUs to the
# prolog and the epilog as SLURM_JOB_GPUS (the node's indices, not the job's renumbered CUDA_VISIBLE_DEVICES).

# Settings: /etc/default/gpukill-slurm (sh, VAR=value lines; slurmd passes the scripts no variables of ours),
# else the environment, else these.
# shellcheck disable=SC1091
[ -r /etc/default/gpukill-slurm ] && . /etc/default/gpukill-slurm
GPUKILL_JOB_MAP_DIR=${GPUKILL_JOB_MAP_DIR-/run/gpukill/job-map}  # "" writes no map
GPUKILL_EPILOG_DRAIN=${GPUKILL_EPILOG_DRAIN-no}  # yes: the epilog fails (Slurm drains the node) if a process stays
GPUKILL_EPILOG_GRACE=${GPUKILL_EPILOG_GRACE-10}  # seconds between SIGTERM and SIGKILL
GPUKILLCTL=${GPUKILLCTL-gpukillctl}

# slurmd discards the scripts' output: say things to the journal (syslog), and to stderr for a person.
# printf, never echo: what is said carries process names (gpukillctl's output), and dash's echo acts on
# backslashes in them (a process named 'x\c' would cut the line there).
say() {
    printf 'gpukill-slurm: %s\n' "$*" >&2
    command -v logger >/dev/null 2>&1 && logger -t gpukill-slurm -- "$*"
    return 0
}

# The job's GPU indices, one a line; nothing for a job without GPUs.
job_gpus() {
    printf '%s\n' "${SLURM_JOB_GPUS-}" | tr ',' '\n' | grep -E '^[0-9]+$' || true
}

# Add (+) or remove (-) the job on each of its GPUs' files. Jobs start and end concurrently: one lock for all,
# each file replaced whole (rename), so dcgm-exporter never reads half a file.
map_job() {
    op=$1
    [ -n "$GPUKILL_JOB_MAP_DIR" ] || return 0
    case "$SLURM_JOB_ID" in ''|*[!0-9]*) say "no job id in SLURM_JOB_ID: GPU map unchanged"; return 0 ;; esac
    mkdir -p -m 0755 "$GPUKILL_JOB_MAP_DIR" || return 1
    (
        flock 9 || exit 1
        for gpu in $(job_gpus); do
            file="$GPUKILL_JOB_MAP_DIR/$gpu"
            tmp="$GPUKILL_JOB_MAP_DIR/.$gpu.tmp"
            { [ -f "$file" ] && grep -vx -- "$SLURM_JOB_ID" "$file"; [ "$op" = + ] && printf '%s\n' "$SLURM_JOB_ID"; } >"$tmp"
            if [ -s "$tmp" ]; then
                chmod 0644 "$tmp" && mv -f "$tmp" "$file"
            else
                rm -f "$tmp" "$file"  # no job left on the GPU
            fi
        done
    ) 9>"$GPUKILL_JOB_MAP_DIR/.lock"
}
