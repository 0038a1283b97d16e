"""The operator's command, `gcs-spawner`: a run is one file (`runfile`), and the commands are verbs on it.

`gcs-spawner plan RUN` prices it, `up RUN` validates it and creates what it needs (recorded in the queue), `status`
watches it and `down RUN` deletes exactly what `up` made. This package sits on the top floor beside `tools/`: it
joins the queue, the extraction's models, the cloud glue and reporting, and none of them imports it.
"""
