"""`verl view`: a run's metrics, samples, episodes and per-token values in a browser, live or as one file.

Modules, one job each: `tail` reads a JSON Lines file a run is still writing; `metrics`, `rows` and `tokens`
index the run's files on top of it; `runs` is the API over a set of run folders; `page` builds the HTML;
`server` serves it live; `report` writes the self-contained file. Importing this package imports neither
plotly nor any of those modules' dependencies beyond the standard library.
"""
