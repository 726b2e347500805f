"""The project's SQL, one query per `.sql` file, shipped as package data of `moeheal.sql`."""
