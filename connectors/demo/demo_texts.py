"""What the demo says to a real chat model: one long system prompt shared by many questions,
and conversations that open with a pasted document and go on with follow-ups.

The system prompt is a help-desk handbook, the kind of long fixed context that every request
of a deployment repeats (and that a prefix cache exists for).
"""

SYSTEM_PROMPT = """\
You are the help desk assistant of the Harbor City Public Library. Answer in one or two short \
sentences, politely, using only the facts in this handbook. If the handbook does not answer a \
question, say so and suggest asking a librarian at the front desk.

OPENING HOURS. The Central Library on Market Street opens Monday to Thursday from 9 in the \
morning to 8 in the evening, Friday and Saturday from 9 to 6, and Sunday from noon to 5. The \
three branch libraries (Northgate, Riverside and Old Town) open Tuesday to Saturday from 10 to \
6 and are closed on Sunday and Monday. All libraries close on New Year's Day, on Independence \
Day, on Thanksgiving Day and on Christmas Day. On the day before a holiday, every library \
closes at 4 in the afternoon.

LIBRARY CARDS. Any person who lives, works or studies in Harbor City can get a library card \
for free. Bring a photo identity document and a proof of address, such as a utility bill or a \
rental contract, dated within the last three months. Children under 14 need a parent or \
guardian to sign the application. A card is valid for three years and can be renewed online or \
at any desk. A lost card is replaced for two dollars. Visitors from outside the city can buy a \
one-year card for thirty dollars.

BORROWING. With a card, a person can borrow up to 30 items at a time. Books and audiobooks \
are lent for three weeks, magazines and films for one week, and laptops for four hours, to be \
used inside the building only. An item can be renewed twice, online or by phone, unless \
another member has reserved it. Reservations are free; when a reserved item arrives, the \
member gets an email or a text message and has seven days to collect it at the chosen \
library.

LATE RETURNS AND FEES. The library charges no late fees on books for children and teenagers. \
For adult cards, a late book costs ten cents a day, up to a maximum of five dollars per item. \
A late laptop costs five dollars an hour. An item that is more than 45 days late is counted as \
lost, and the member is billed its replacement price; the bill is cancelled when the item \
comes back in good condition. A card with more than ten dollars of unpaid fees cannot borrow \
until the fees are paid. Fees can be paid online, by card at any desk, or in cash.

RETURNING ITEMS. Items can be returned at any of the four libraries, whichever one lent them. \
Each library has an outdoor book drop that is open all day and all night, except for laptops, \
which must be handed to a member of staff at the desk. Items dropped in the book drop on a \
day when the library is closed are counted as returned on the next opening day.

COMPUTERS, PRINTING AND WIRELESS. Every library has public computers, which members can book \
for two hours a day, and a free wireless network called HarborLibrary that needs no password. \
Printing costs ten cents a page in black and white and fifty cents a page in colour. Members \
can print from their own phones and laptops by sending the file to the print address shown \
on the screens near the printers. Scanning to email is free.

ROOMS. The Central Library has four meeting rooms for up to twelve people and one hall for \
up to eighty people. Meeting rooms are free for members and can be booked up to thirty days \
ahead for at most three hours. The hall must be booked at least two weeks ahead by a \
non-profit group; it costs forty dollars for an evening. Quiet study rooms for one or two \
people are available at every library on a first-come basis.

CHILDREN AND TEENS. Story time for children under five takes place on Tuesday and Thursday \
at 10:30 at the Central Library and on Wednesday at 10:30 at every branch. Homework help with \
volunteer tutors is offered Monday to Thursday from 4 to 6 at the Central Library. The teen \
room on the second floor of the Central Library is for members aged 13 to 18 only.

ACCESSIBILITY. All four libraries have step-free entrances and accessible toilets. The \
Central Library lends magnifiers and reading pens, and has a reading machine for blind and \
partially sighted members in room 104. Members who cannot leave their homes can ask for the \
home delivery service, which brings books every two weeks at no cost.

DONATIONS AND VOLUNTEERING. The library accepts donations of books in good condition that \
were published in the last ten years, on Saturday mornings at the Central Library. It does not \
accept textbooks, encyclopedias or magazines. People who want to volunteer can fill in the \
form on the website; volunteers must be at least 16 years old and give at least two hours a \
week.

CONTACT. The phone number of the help desk is 555-0142, answered during opening hours. \
Questions can also be sent by email to help@harborcitylibrary.org, and are answered within \
two working days.
"""

QUESTIONS = [
    "What time does the Central Library open on Sunday?",
    "How many items can I borrow at once?",
    "I returned a book ten days late. How much do I owe?",
    "Can I return a book at a different library?",
    "Is the wireless network free, and what is it called?",
    "How do I get a library card for my 10-year-old son?",
    "When is story time at the branch libraries?",
    "Do you accept old encyclopedias as donations?",
]

CONVERSATIONS = [
    ["I'm planning a short trip and need help with the itinerary. Here are my notes:\n\n"
     "Day 1: arrive in Lisbon at nine in the morning on the flight from Amsterdam, take the metro "
     "from the airport to the hotel near Rossio square and leave the bags there. Walk through the "
     "Baixa and Chiado neighbourhoods, stop for coffee at the old cafe with the bronze statue of "
     "the poet outside, then take the yellow tram 28 up the hill to the castle of Sao Jorge. Spend "
     "the afternoon on the castle walls, which have the best view of the river and the red roofs. "
     "In the evening, walk down through the narrow streets of Alfama and have dinner in a small "
     "restaurant with live fado music; book a table in advance, because they fill up early.\n"
     "Day 2: take the train from Cais do Sodre station to Belem, which takes about fifteen minutes. "
     "Visit the Jeronimos monastery in the morning before the queues get long, then walk along "
     "the river to the Belem tower and the monument to the discoveries. Eat the famous custard "
     "tarts at the bakery that has made them since 1837. Go back to the city in the afternoon, "
     "rest at the hotel, and see the sunset from the Senhora do Monte viewpoint, the highest one "
     "in the city.\n"
     "Day 3: a day trip to Sintra by train from Rossio station, forty minutes each way. See the "
     "colourful Pena palace on the top of the hill, the Moorish castle, and the gardens and the "
     "initiation well of Quinta da Regaleira. Be back in Lisbon by six in the evening, pick up the "
     "bags, and take the metro to the airport for the flight home at nine.\n\n"
     "What is the first thing I do on day 1?",
     "Which day has the trip to Sintra?",
     "Where should I go for the sunset on day 2?"],
    ["Here is the recipe I want to cook tonight for four people:\n\n"
     "Ingredients: 400 grams of spaghetti, 4 cloves of garlic, 6 tablespoons of good olive oil, "
     "one small red chili, a large handful of fresh flat-leaf parsley, the zest of one lemon, "
     "salt, black pepper, and 60 grams of grated parmesan cheese. Optional: a handful of toasted "
     "breadcrumbs for the top.\n"
     "Steps: bring a large pot of water to the boil and add two tablespoons of salt; the water "
     "should taste like the sea. Cook the spaghetti for one minute less than the packet says, so "
     "that it stays al dente. Meanwhile, peel the garlic and slice it as thinly as you can. Warm "
     "the olive oil in a wide pan over low heat, add the garlic and the finely chopped chili, and "
     "cook slowly for four or five minutes, stirring, until the garlic is golden, not brown: "
     "brown garlic tastes bitter, so take the pan off the heat as soon as the colour turns. "
     "Before you drain the pasta, keep a cup of the cooking water. Drain the spaghetti and put it "
     "straight into the pan with the garlic oil. Add a splash of the cooking water and toss "
     "everything over medium heat for a minute, until the oil and water turn into a light, "
     "glossy sauce that coats the pasta. Take the pan off the heat, add the chopped parsley and "
     "the lemon zest, and season with black pepper. Serve at once in warm bowls, with the "
     "parmesan and the breadcrumbs on the table so that everyone can add their own.\n\n"
     "What do I need to boil the spaghetti in?",
     "What color should the garlic be?",
     "What do I serve it with?"],
    ["These are the minutes of our team meeting this morning:\n\n"
     "Present: Ana (chair), Bruno, Chen and Dara. Apologies: Emil, who is on holiday.\n"
     "1. Ana opened the meeting at ten and the minutes of the last meeting were approved.\n"
     "2. Website. Bruno reported that the new website will launch on the fifteenth of next "
     "month, one week later than planned, because the payment page still fails two of its "
     "tests: card payments from some foreign banks are refused. The supplier has promised a fix "
     "by Friday. Bruno will send the team a link to the test site so that everyone can try it and "
     "report problems before the launch.\n"
     "3. Budget. Chen presented the budget: the team has spent sixty percent of the year's money "
     "after seven months, which is on track. The biggest cost is still the website. Chen asked "
     "everyone to send travel requests for the autumn conference before the end of the month.\n"
     "4. Training. Dara proposed a training day on customer service in the spring, run by an "
     "outside trainer, for the whole team and the two new members who start in March. Everyone "
     "agreed. Dara will ask three trainers for prices and bring them to the next meeting.\n"
     "5. Office. The coffee machine on the second floor is broken again; Ana will call the "
     "repair company.\n"
     "6. Next meeting: Thursday at two in the afternoon, in the small meeting room.\n\n"
     "When will the website launch?",
     "Why is it late?",
     "When is the next meeting?"],
    ["I wrote this poem for my grandmother's ninetieth birthday. Can you help me with it?\n\n"
     "In your garden the roses grow,\nred and white in a tidy row.\nYou taught me how to plant "
     "a seed,\nand how a little care is all they need.\n\nYou kept the apples on the shelf,\n"
     "and baked the pies yourself,\nthe kitchen warm, the window wide,\nthe smell of cinnamon "
     "inside.\n\nYou walked with me down to the sea,\nand named each bird and every tree,\n"
     "the gull, the heron and the wren,\nthe oak, the birch, and back again.\n\nYou told me "
     "stories of the war,\nof dancing at the harbour door,\nof letters sent across the "
     "foam,\nand how grandfather came home.\n\nNinety years of sun and rain,\nof many joys "
     "and some pain,\nand still you smile when spring comes round,\nand roses push up through "
     "the ground.\n\nSo here is to the years you gave,\nthe seeds you planted, and the "
     "brave\nand gentle heart that taught us all\nto stand up tall, and not to fall.\n\n"
     "How old is my grandmother turning?",
     "What flowers are in the poem?",
     "Give the poem a title."],
]
