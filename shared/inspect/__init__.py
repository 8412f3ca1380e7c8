"""The operator's tools over a finished or running run. No role imports this.

cli.py     `millstream inspect RUN_DIR`: find episodes in the trajectory store, read one
query.py   the questions behind it (which episodes; one episode token by token)
web.py     `millstream inspect RUN_DIR --serve`: the store on a local web page (page.html)
plot.py    `millstream plot RUN_DIR`: the run's curves as PNGs
"""
