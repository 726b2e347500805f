"""The lake and its keys: stage outputs on disk, fingerprints, code identity, the DAG and its executors."""
