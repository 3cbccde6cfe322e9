"""The report: training, offline and live results joined into report.md, report.json and plots; the demo's summary."""
