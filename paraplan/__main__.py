from paraplan.cli import console

console()
