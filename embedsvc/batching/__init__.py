"""Admission, the micro-batcher and heap trimming: how inputs from many requests reach the
device together."""
