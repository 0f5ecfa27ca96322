"""End-to-end tests: each starts processes (a program, a launcher, a subprocess) and checks what
they do and write."""
