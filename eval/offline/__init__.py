"""Offline accept length: a drafter scored on stored target features, held-out or the bench's own answers."""
