"""Reserved: this adapter arrives with its own issue."""
