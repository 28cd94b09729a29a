"""Sending: one message in one statement, many through COPY; the rules a message must meet."""
