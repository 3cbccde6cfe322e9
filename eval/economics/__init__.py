"""Speculation economics: what a cycle costs, the break-even accept length, and tok/s predicted from offline tau."""
