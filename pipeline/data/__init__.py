"""The lake's data, read and written: documents, traces and windows (Parquet), activation dumps (Zarr)."""
