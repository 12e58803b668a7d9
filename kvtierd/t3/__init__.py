"""T3: a shared tier on an existing Redis Cluster, single Redis or Valkey."""
