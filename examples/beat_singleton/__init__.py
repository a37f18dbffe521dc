"""A beat job longer than its period, sent by two beats: runs never overlap, surplus ticks are skipped."""
