"""The plain-text table `pagedserve bench` prints; apart from the statistics so they
stay pure data (JSON, plots) and the wording can change without touching them."""

from __future__ import annotations

from .stats import Distribution, Summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_summary(summary: Summary, title: str = "") -> str:
    """A plain-text table of the run (latencies in ms)."""
    lines = [title] if title else []
    lines.append(
        f"requests {summary.num_requests}  ok {summary.num_ok}  errors {summary.num_errors}  "
        f"window {summary.window_s:.1f} s  prompt tokens {summary.total_prompt_tokens}  "
        f"output tokens {summary.total_output_tokens}"
    )
    lines.append(f"throughput  {summary.requests_per_s:.2f} req/s  {summary.output_tokens_per_s:.1f} output tok/s")
    per_response = summary.client_cpu_per_response_us
    if per_response is not None and summary.client_cpu_s is not None:  # both, or neither
        share = summary.client_cpu_s / summary.window_s if summary.window_s > 0 else 0.0
        lines.append(f"client CPU  {summary.client_cpu_s:.2f} s: {per_response:.0f} us per streamed response "
                     f"({share:.1%} of a core; it shares the machine with the server when local)")
    lines.append(f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'samples':>10}")
    for name in ("ttft", "itl", "tpot", "e2e"):
        d: Distribution = getattr(summary, name)
        lines.append(f"{name.upper():<6}{_ms(d.mean):>10}{_ms(d.p50):>10}{_ms(d.p90):>10}{_ms(d.p99):>10}{d.count:>10}")
    for example in summary.error_examples:
        lines.append(f"error: {example}")
    return "\n".join(lines)
