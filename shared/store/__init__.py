"""What a run keeps on disk.

trajstore.py   every episode of a run in one SQLite file, `RUN_DIR/store.sqlite`: tables, reads
writer.py      the learner's writer of that file: its own thread, retention, a size cap
rows.py        the store's rows, and how protocol messages become rows
rundir.py      the run directory: its layout, where a resume continues, what it may change
"""
