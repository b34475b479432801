"""Directories the program owns: descriptor-relative, no-follow access (dirfd) and the one judgement of
which entries are the program's own (layout). OwnershipError is the one refusal of both."""

from shards.common.owned.dirfd import DIR_MODE, FILE_MODE, PROBE, TMP_PREFIX, Dir, OwnershipError, not_own_file
from shards.common.owned.layout import (
    LOCK_FILE,
    READER_PREFIX,
    READER_RECORD,
    Entry,
    Layout,
    Survey,
    check_output_file,
    describe,
    judge,
    nested,
    remove_empty_folders,
    remove_entries,
    survey,
)

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "LOCK_FILE",
    "PROBE",
    "READER_PREFIX",
    "READER_RECORD",
    "TMP_PREFIX",
    "Dir",
    "Entry",
    "Layout",
    "OwnershipError",
    "Survey",
    "check_output_file",
    "describe",
    "judge",
    "nested",
    "not_own_file",
    "remove_empty_folders",
    "remove_entries",
    "survey",
]
