"""Argument types of the command line: each refuses a bad value before the command prints or reads anything."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def memory_share(text: str) -> float:
    """A fraction of GPU memory, as vLLM's gpu_memory_utilization: in (0, 1]."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not a share of GPU memory in (0, 1]")
    return value


def _number(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
