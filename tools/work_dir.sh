# Sourced by tools/demo.sh and tools/fp8_acceptance.sh: `fresh_work_dir DIR` gives an empty DIR for a
# run, deleting only what an earlier run of these scripts made there (a directory holding their marker
# file); anything else in the way is refused with a message, never deleted.
work_dir_marker=.dflash-work-dir

fresh_work_dir() {
    local dir="$1"
    if [ -f "$dir/$work_dir_marker" ]; then
        rm -rf "$dir"
    elif [ -e "$dir" ] && { [ ! -d "$dir" ] || [ -n "$(ls -A "$dir")" ]; }; then
        echo "$0: $dir exists and was not made by an earlier run of this script (no $dir/$work_dir_marker):" \
            "nothing was deleted; pass another WORK_DIR, or move $dir away" >&2
        return 1
    fi
    mkdir -p "$dir"
    echo "made by $0: deleted and remade by its next run" > "$dir/$work_dir_marker"
}
