"""Command-line entrances: launch-stack (the supervisor) and verity (clients, benches)."""
