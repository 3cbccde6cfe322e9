"""The eval stage: offline accept length, embedded speculation, live benchmark, economics, report."""
