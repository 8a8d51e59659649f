from llmrun.cli import main

main()
