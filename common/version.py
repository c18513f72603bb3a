"""The version of unison, in a module of its own so that the launcher can
say it without importing the root package."""
VERSION = "0.1.0"
