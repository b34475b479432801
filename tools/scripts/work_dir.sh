# Sourced by tools/scripts/demo.sh and tools/scripts/fp8_acceptance.sh: `fresh_work_dir DIR` gives DIR for a run,
# deleting only what an earlier run of these scripts wrote there: the entries its marker file lists,
# recorded by `record_work_dir DIR` when that run exited (the scripts call it from their EXIT trap).
# Anything else is kept; a DIR these scripts did not make, or whose earlier run was killed before it
# could record its entries, is refused with a message, and nothing is deleted.
work_dir_marker=.dflash-work-dir

fresh_work_dir() {
    local dir="$1" marker="$1/$work_dir_marker" name
    if [ -f "$marker" ]; then
        if ! grep -qx "entries recorded" "$marker"; then
            echo "$0: $dir was made by an earlier run of this script that was killed before it recorded what it" \
                "wrote (or by an older version, which recorded nothing): nothing was deleted; delete $dir" \
                "yourself, or pass another WORK_DIR" >&2
            return 1
        fi
        local removed=""
        while IFS= read -r name; do
            case "$name" in "entry "*) name="${name#entry }" ;; *) continue ;; esac  # a recorded entry
            case "$name" in
                "" | . | .. | */* | "$work_dir_marker") ;;
                *) if [ -e "$dir/$name" ] || [ -L "$dir/$name" ]; then
                       rm -rf -- "${dir:?}/$name" && removed="$removed $name"
                   fi ;;
            esac
        done < "$marker"
        # Said on screen: a re-run replaces the earlier run's outputs, which the user may have wanted.
        [ -z "$removed" ] || echo "$0: deleted what the earlier run of this script wrote in $dir:$removed" >&2
        rm -f -- "$marker"
        if [ -n "$(ls -A "$dir")" ]; then
            echo "$0: kept what the earlier run did not write in $dir: $(ls -A "$dir" | tr '\n' ' ')" >&2
        fi
    elif [ -e "$dir" ] && { [ ! -d "$dir" ] || [ -n "$(ls -A "$dir")" ]; }; then
        echo "$0: $dir exists and was not made by an earlier run of this script (no $dir/$work_dir_marker):" \
            "nothing was deleted; pass another WORK_DIR, or move $dir away" >&2
        return 1
    fi
    mkdir -p "$dir"
    # What is already there (kept above) is not this run's: only entries new at exit get recorded.
    { echo "made by $0: what it wrote is deleted by its next run"; ls -A "$dir" | sed -e "/^${work_dir_marker}\$/d" -e 's/^/kept /'; } > "$marker"
}

record_work_dir() {
    local dir="$1" marker="$1/$work_dir_marker" name
    [ -f "$marker" ] || return 0
    grep -qx "entries recorded" "$marker" && return 0
    local entries
    entries="$(ls -A "$dir" | while IFS= read -r name; do
        [ "$name" = "$work_dir_marker" ] || grep -qxF "kept $name" "$marker" || echo "entry $name"
    done)"
    { [ -z "$entries" ] || echo "$entries"; echo "entries recorded"; } >> "$marker"
}
