"""A task with a short lock timeout retried with growing countdowns until the lock is free."""
