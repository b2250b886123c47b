"""Experiments: benchmarks that write records, analysis and plots that read them, statistics, reports."""
