from llmrun.entry import main

main()
