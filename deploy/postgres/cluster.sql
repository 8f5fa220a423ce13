-- The database of the compose cluster profile's worker (worker-cluster). Postgres's
-- image runs this once, when it initialises an empty data volume.
CREATE DATABASE idem_cluster;
