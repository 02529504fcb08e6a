"""Profiling and trace tools: where a rollout's or an update's time goes (GPU idle gaps, host time, saved Chrome
traces) and A/B runs that time two trees or two engine option sets alternately."""
