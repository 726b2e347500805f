"""What a run publishes: the tables of the contract, the report and the export bundle."""
