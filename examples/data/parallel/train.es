LIBRO de la generación de Jesucristo, hijo de David, hijo de Abraham.
Abraham engendró á Isaac: é Isaac engendró á Jacob: y Jacob engendró á Judas y á sus hermanos:
Y Judas engendró de Thamar á Phares y á Zara: y Phares engendró á Esrom: y Esrom engendró á Aram:
Y Aram engendró á Aminadab: y Aminadab engendró á Naassón: y Naassón engendró á Salmón:
Y Salmón engendró de Rachâb á Booz, y Booz engendró de Ruth á Obed: y Obed engendró á Jessé:
Y Jessé engendró al rey David: y el rey David engendró á Salomón de laque fué mujerde Urías:
Y Salomón engendró á Roboam: y Roboam engendró á Abía: y Abía engendró á Asa:
Y Asa engendró á Josaphat: y Josaphat engendró á Joram: y Joram engendró á Ozías:
Y Ozías engendró á Joatam: y Joatam engendró á Achâz: y Achâz engendró á Ezechîas:
Y Ezechîas engendró á Manasés: y Manasés engendró á Amón: y Amón engendró á Josías:
Y Josías engendró á Jechônías y á sus hermanos, en la transmigración de Babilonia.
Y después de la transmigración de Babilonia, Jechônías engendró á Salathiel: y Salathiel engendró á Zorobabel:
Y Zorobabel engendró á Abiud: y Abiud engendró á Eliachîm: y Eliachîm engendró á Azor:
Y Azor engendró á Sadoc: y Sadoc engendró á Achîm: y Achîm engendró á Eliud:
Y Eliud engendró á Eleazar: y Eleazar engendró á Mathán: y Mathán engendró á Jacob:
Y Jacob engendró á José, marido de María, de la cual nació Jesús, el cual es llamado el Cristo.
Y el nacimiento de Jesucristo fué así: Que siendo María su madre desposada con José, antes que se juntasen, se halló haber concebido del Espíritu Santo.
Y José su marido, como era justo, y no quisiese infamarla, quiso dejarla secretamente.
Y parirá un hijo, y llamarás su nombre JESUS, porque él salvará á su pueblo de sus pecados.
Todo esto aconteció para que se cumpliese lo que fué dicho por el Señor, por el profeta que dijo:
He aquí la virgen concebirá y parirá un hijo, y llamarás su nombre Emmanuel, que declarado, es: Con nosotros Dios.
Y despertando José del sueño, hizo como el ángel del Señor le había mandado, y recibió á su mujer.
Y no la conoció hasta que parió á su hijo primogénito: y llamó su nombre JESUS.
Y COMO fué nacido Jesús en Bethlehem de Judea en días del rey Herodes, he aquí unos magos vinieron del oriente á Jerusalem,
Diciendo: ¿Dónde está el Rey de los Judíos, que ha nacido? porque su estrella hemos visto en el oriente, y venimos á adorarle.
Y oyendo esto el rey Herodes, se turbó, y toda Jerusalem con él.
Y convocados todos los príncipes de los sacerdotes, y los escribas del pueblo, les preguntó dónde había de nacer el Cristo.
Y ellos le dijeron: En Bethlehem de Judea; porque así está escrito por el profeta:
Y tú, Bethlehem, de tierra de Judá, no eres muy pequeña entre los príncipes de Judá; porque de ti saldrá un guiador, que apacentará á mi pueblo Israel.
Entonces Herodes, llamando en secreto á los magos, entendió de ellos diligentemente el tiempo del aparecimiento de la estrella;
Y enviándolos á Bethlehem, dijo: Andad allá, y preguntad con diligencia por el niño; y después que le hallareis, hacédmelo saber, para que yo también vaya y le adore.
Y ellos, habiendo oído al rey, se fueron: y he aquí la estrella que habían visto en el oriente, iba delante de ellos, hasta que llegando, se puso sobre donde estaba el niño.
Y vista la estrella, se regocijaron con muy grande gozo.
Y entrando en la casa, vieron al niño con su madre María, y postrándose, le adoraron; y abriendo sus tesoros, le ofrecieron dones, oro é incienso y mirra.
Y siendo avisados por revelación en sueños que no volviesen á Herodes, se volvieron á su tierra por otro camino.
Y él despertando, tomó al niño y á su madre de noche, y se fué á Egipto;
Y estuvo allá hasta la muerte de Herodes: para que se cumpliese lo que fué dicho por el Señor, por el profeta que dijo: De Egipto llamé á mi Hijo.
Entonces fué cumplido lo que se había dicho por el profeta Jeremías, que dijo:
Voz fué oída en Ramá, grande lamentación, lloro y gemido: Rachêl que llora sus hijos; y no quiso ser consolada, porque perecieron.
Mas muerto Herodes, he aquí el ángel del Señor aparece en sueños á José en Egipto,
Diciendo: Levántate, y toma al niño y á su madre, y vete á tierra de Israel; que muertos son los que procuraban la muerte del niño.
Entonces él se levantó, y tomó al niño y á su madre, y se vino á tierra de Israel.
Y oyendo que Archelao reinaba en Judea en lugar de Herodes su padre, temió ir allá: mas amonestado por revelación en sueños, se fué á las partes de Galilea.
Y vino, y habitó en la ciudad que se llama Nazaret: para que se cumpliese lo que fué dicho por los profetas, que había de ser llamado Nazareno.
Y EN aquellos días vino Juan el Bautista predicando en el desierto de Judea,
Y diciendo: Arrepentíos, que el reino de los cielos se ha acercado.
Porque éste es aquel del cual fué dicho por el profeta Isaías, que dijo: Voz de uno que clama en el desierto: Aparejad el camino del Señor, enderezad sus veredas.
Y tenía Juan su vestido de pelos de camellos, y una cinta de cuero alrededor de sus lomos; y su comida era langostas y miel silvestre.
Entonces salía á él Jerusalem, y toda Judea, y toda la provincia de alrededor del Jordán;
Y eran bautizados de él en el Jordán, confesando sus pecados.
Y viendo él muchos de los Fariseos y de los Saduceos, que venían á su bautismo, decíales: Generación de víboras, ¿quién os ha enseñado á huir de la ira que vendrá?
Haced pues frutos dignos de arrepentimiento,
Y no penséis decir dentro de vosotros: A Abraham tenemos por padre: porque yo os digo, que puede Dios despertar hijos á Abraham aun de estas piedras.
Ahora, ya también la segur está puesta á la raíz de los árboles; y todo árbol que no hace buen fruto, es cortado y echado en el fuego.
Yo á la verdad os bautizo en agua para arrepentimiento; mas el que viene tras mí, más poderoso es que yo; los zapatos del cual yo no soy digno de llevar; él os bautizará en Espíritu Santo y en fuego.
Su aventador en su mano está, y aventará su era: y allegará su trigo en el alfolí, y quemará la paja en fuego que nunca se apagará.
Entonces Jesús vino de Galilea á Juan al Jordán, para ser bautizado de él.
Mas Juan lo resistía mucho, diciendo: Yo he menester ser bautizado de ti, ¿y tú vienes á mí?
Empero respondiendo Jesús le dijo: Deja ahora; porque así nos conviene cumplir toda justicia. Entonces le dejó.
Y Jesús, después que fué bautizado, subió luego del agua; y he aquí los cielos le fueron abiertos, y vió al Espíritu de Dios que descendía como paloma, y venía sobre él.
Y he aquí una voz de los cielos que decía: Este es mi Hijo amado, en el cual tengo contentamiento.
ENTONCES Jesús fué llevado del Espíritu al desierto, para ser tentado del diablo.
Y habiendo ayunado cuarenta días y cuarenta noches, después tuvo hambre.
Y llegándose á él el tentador, dijo: Si eres Hijo de Dios, di que estas piedras se hagan pan.
Mas él respondiendo, dijo: Escrito está: No con solo el pan vivirá el hombre, mas con toda palabra que sale de la boca de Dios.
Entonces el diablo le pasa á la santa ciudad, y le pone sobre las almenas del templo,
Jesús le dijo: Escrito está además: No tentarás al Señor tu Dios.
Otra vez le pasa el diablo á un monte muy alto, y le muestra todos los reinos del mundo, y su gloria,
Y dícele: Todo esto te daré, si postrado me adorares.
Entonces Jesús le dice: Vete, Satanás, que escrito está: Al Señor tu Dios adorarás y á él solo servirás.
El diablo entonces le dejó: y he aquí los ángeles llegaron y le servían.
Mas oyendo Jesús que Juan era preso, se volvió á Galilea;
Y dejando á Nazaret, vino y habitó en Capernaum, ciudad marítima, en los confines de Zabulón y de Nephtalim:
Para que se cumpliese lo que fué dicho por el profeta Isaías, que dijo:
La tierra de Zabulón, y la tierra de Nephtalim, camino de la mar, de la otra parte del Jordán, Galilea de los Gentiles;
El pueblo asentado en tinieblas, vió gran luz; y á los sentados en región y sombra de muerte, luz les esclareció.
Desde entonces comenzó Jesús á predicar, y á decir: Arrepentíos, que el reino de los cielos se ha acercado.
Y andando Jesús junto á la mar de Galilea, vió á dos hermanos, Simón, que es llamado Pedro, y Andrés su hermano, que echaban la red en la mar; porque eran pescadores.
Y díceles: Venid en pos de mí, y os haré pescadores de hombres.
Ellos entonces, dejando luego las redes, le siguieron.
Y pasando de allí vió otros dos hermanos, Jacobo, hijo de Zebedeo, y Juan su hermano, en el barco con Zebedeo, su padre, que remendaban sus redes; y los llamó.
Y ellos, dejando luego el barco y á su padre, le siguieron.
Y rodeó Jesús toda Galilea, enseñando en las sinagogas de ellos, y predicando el evangelio del reino, y sanando toda enfermedad y toda dolencia en el pueblo.
Y le siguieron muchas gentes de Galilea y de Decápolis y de Jerusalem y de Judea y de la otra parte del Jordán.
Y VIENDO las gentes, subió al monte; y sentándose, se llegaron á él sus discípulos.
Y abriendo su boca, les enseñaba, diciendo:
Bienaventurados los pobres en espíritu: porque de ellos es el reino de los cielos.
Bienaventurados los que lloran: porque ellos recibirán consolación.
Bienaventurados los mansos: porque ellos recibirán la tierra por heredad.
Bienaventurados los que tienen hambre y sed de justicia: porque ellos serán hartos.
Bienaventurados los misericordiosos: porque ellos alcanzarán misericordia.
Bienaventurados los de limpio corazón: porque ellos verán á Dios.
Bienaventurados los pacificadores: porque ellos serán llamados hijos de Dios.
Bienaventurados los que padecen persecución por causa de la justicia: porque de ellos es el reino de los cielos.
Bienaventurados sois cuando os vituperaren y os persiguieren, y dijeren de vosotros todo mal por mi causa, mintiendo.
Gozaos y alegraos; porque vuestra merced es grande en los cielos: que así persiguieron á los profetas que fueron antes de vosotros.
Vosotros sois la sal de la tierra: y si la sal se desvaneciere ¿con qué será salada? no vale más para nada, sino para ser echada fuera y hollada de los hombres.
Vosotros sois la luz del mundo: una ciudad asentada sobre un monte no se puede esconder.
Ni se enciende una lámpara y se pone debajo de un almud, mas sobre el candelero, y alumbra á todos los que están en casa.
Así alumbre vuestra luz delante de los hombres, para que vean vuestras obras buenas, y glorifiquen á vuestro Padre que está en los cielos.
No penséis que he venido para abrogar la ley ó los profetas: no he venido para abrogar, sino á cumplir.
Porque de cierto os digo, que hasta que perezca el cielo y la tierra, ni una jota ni un tilde perecerá de la ley, hasta que todas las cosas sean hechas.
Porque os digo, que si vuestra justicia no fuere mayor que la de los escribas y de los Fariseos, no entraréis en el reino de los cielos.
Oísteis que fué dicho á los antiguos: No matarás; mas cualquiera que matare, será culpado del juicio.
Por tanto, si trajeres tu presente al altar, y allí te acordares de que tu hermano tiene algo contra ti,
Deja allí tu presente delante del altar, y vete, vuelve primero en amistad con tu hermano, y entonces ven y ofrece tu presente.
Concíliate con tu adversario presto, entre tanto que estás con él en el camino; porque no acontezca que el adversario te entregue al juez, y el juez te entregue al alguacil, y seas echado en prisión.
De cierto te digo, que no saldrás de allí, hasta que pagues el último cuadrante.
Oísteis que fué dicho: No adulterarás:
Mas yo os digo, que cualquiera que mira á una mujer para codiciarla, ya adulteró con ella en su corazón.
También fué dicho: Cualquiera que repudiare á su mujer, déle carta de divorcio:
Mas yo os digo, que el que repudiare á su mujer, fuera de causa de fornicación, hace que ella adultere; y el que se casare con la repudiada, comete adulterio.
Además habéis oído que fué dicho á los antiguos: No te perjurarás; mas pagarás al Señor tus juramentos.
Mas yo os digo: No juréis en ninguna manera: ni por el cielo, porque es el trono de Dios;
Ni por la tierra, porque es el estrado de sus pies; ni por Jerusalem, porque es la ciudad del gran Rey.
Ni por tu cabeza jurarás, porque no puedes hacer un cabello blanco ó negro.
Mas sea vuestro hablar: Sí, sí; No, no; porque lo que es más de esto, de mal procede.
Oísteis que fué dicho á los antiguos: Ojo por ojo, y diente por diente.
Mas yo os digo: No resistáis al mal; antes á cualquiera que te hiriere en tu mejilla diestra, vuélvele también la otra;
Y al que quisiere ponerte á pleito y tomarte tu ropa, déjale también la capa;
Y á cualquiera que te cargare por una milla, ve con él dos.
Al que te pidiere, dale; y al que quisiere tomar de ti prestado, no se lo rehuses.
Oísteis que fué dicho: Amarás á tu prójimo, y aborrecerás á tu enemigo.
Mas yo os digo: Amad á vuestros enemigos, bendecid á los que os maldicen, haced bien á los que os aborrecen, y orad por los que os ultrajan y os persiguen;
Para que seáis hijos de vuestro Padre que está en los cielos: que hace que su sol salga sobre malos y buenos, y llueve sobre justos é injustos.
Porque si amareis á los que os aman, ¿qué recompensa tendréis? ¿no hacen también lo mismo los publicanos?
Y si abrazareis á vuestros hermanos solamente, ¿qué hacéis de más? ¿no hacen también así los Gentiles?
Sed, pues, vosotros perfectos, como vuestro Padre que está en los cielos es perfecto.
MIRAD que no hagáis vuestra justicia delante de los hombres, para ser vistos de ellos: de otra manera no tendréis merced de vuestro Padre que está en los cielos.
Mas cuando tú haces limosna, no sepa tu izquierda lo que hace tu derecha;
Para que sea tu limosna en secreto: y tu Padre que ve en secreto, él te recompensará en público.
Mas tú, cuando oras, éntrate en tu cámara, y cerrada tu puerta, ora á tu Padre que está en secreto; y tu Padre que ve en secreto, te recompensará en público.
Y orando, no seáis prolijos, como los Gentiles; que piensan que por su parlería serán oídos.
No os hagáis, pues, semejantes á ellos; porque vuestro Padre sabe de qué cosas tenéis necesidad, antes que vosotros le pidáis.
Vosotros pues, oraréis así: Padre nuestro que estás en los cielos, santificado sea tu nombre.
Venga tu reino. Sea hecha tu voluntad, como en el cielo, así también en la tierra.
Danos hoy nuestro pan cotidiano.
Y perdónanos nuestras deudas, como también nosotros perdonamos á nuestros deudores.
Y no nos metas en tentación, mas líbranos del mal: porque tuyo es el reino, y el poder, y la gloria, por todos los siglos. Amén.
Porque si perdonareis á los hombres sus ofensas, os perdonará también á vosotros vuestro Padre celestial.
Mas si no perdonareis á los hombres sus ofensas, tampoco vuestro Padre os perdonará vuestras ofensas.
Mas tú, cuando ayunas, unge tu cabeza y lava tu rostro;
Para no parecer á los hombres que ayunas, sino á tu Padre que está en secreto: y tu Padre que ve en secreto, te recompensará en público.
No os hagáis tesoros en la tierra, donde la polilla y el orín corrompe, y donde ladrones minan y hurtan;
Mas haceos tesoros en el cielo, donde ni polilla ni orín corrompe, y donde ladrones no minan ni hurtan:
Porque donde estuviere vuestro tesoro, allí estará vuestro corazón.
La lámpara del cuerpo es el ojo: así que, si tu ojo fuere sincero, todo tu cuerpo será luminoso:
Mas si tu ojo fuere malo, todo tu cuerpo será tenebroso. Así que, si la lumbre que en ti hay son tinieblas, ¿cuántas serán las mismas tinieblas?
Ninguno puede servir á dos señores; porque ó aborrecerá al uno y amará al otro, ó se llegará al uno y menospreciará al otro: no podéis servir á Dios y á Mammón.
Mirad las aves del cielo, que no siembran, ni siegan, ni allegan en alfolíes; y vuestro Padre celestial las alimenta. ¿No sois vosotros mucho mejores que ellas?
Mas ¿quién de vosotros podrá, congojándose, añadir á su estatura un codo?
Y por el vestido ¿por qué os congojáis? Reparad los lirios del campo, cómo crecen; no trabajan ni hilan;
Mas os digo, que ni aun Salomón con toda su gloria fué vestido así como uno de ellos.
Y si la hierba del campo que hoy es, y mañana es echada en el horno, Dios la viste así, ¿no hará mucho más á vosotros, hombres de poca fe?
No os congojéis pues, diciendo: ¿Qué comeremos, ó qué beberemos, ó con qué nos cubriremos?
Porque los Gentiles buscan todas estas cosas: que vuestro Padre celestial sabe que de todas estas cosas habéis menester.
Mas buscad primeramente el reino de Dios y su justicia, y todas estas cosas os serán añadidas.
Así que, no os congojéis por el día de mañana; que el día de mañana traerá su fatiga: basta al día su afán.
NO juzguéis, para que no seáis juzgados.
Porque con el juicio con que juzgáis, seréis juzgados; y con la medida con que medís, os volverán á medir.
Y ¿por qué miras la mota que está en el ojo de tu hermano, y no echas de ver la viga que está en tu ojo?
O ¿cómo dirás á tu hermano: Espera, echaré de tu ojo la mota, y he aquí la viga en tu ojo?
¡Hipócrita! echa primero la viga de tu ojo, y entonces mirarás en echar la mota del ojo de tu hermano.
No deis lo santo á los perros, ni echéis vuestras perlas delante de los puercos; porque no las rehuellen con sus pies, y vuelvan y os despedacen.
Pedid, y se os dará; buscad, y hallaréis; llamad, y se os abrirá.
Porque cualquiera que pide, recibe; y el que busca, halla; y al que llama, se abrirá.
¿Qué hombre hay de vosotros, á quien si su hijo pidiere pan, le dará una piedra?
¿Y si le pidiere un pez, le dará una serpiente?
Pues si vosotros, siendo malos, sabéis dar buenas dádivas á vuestros hijos, ¿cuánto más vuestro Padre que está en los cielos, dará buenas cosas á los que le piden?
Así que, todas las cosas que quisierais que los hombres hiciesen con vosotros, así también haced vosotros con ellos; porque esta es la ley y los profetas.
Entrad por la puerta estrecha: porque ancha es la puerta, y espacioso el camino que lleva á perdición, y muchos son los que entran por ella.
Porque estrecha es la puerta, y angosto el camino que lleva á la vida, y pocos son los que la hallan.
Y guardaos de los falsos profetas, que vienen á vosotros con vestidos de ovejas, mas de dentro son lobos rapaces.
Por sus frutos los conoceréis. ¿Cógense uvas de los espinos, ó higos de los abrojos?
Así, todo buen árbol lleva buenos frutos; mas el árbol maleado lleva malos frutos.
No puede el buen árbol llevar malos frutos, ni el árbol maleado llevar frutos buenos.
Todo árbol que no lleva buen fruto, córtase y échase en el fuego.
Así que, por sus frutos los conoceréis.
No todo el que me dice: Señor, Señor, entrará en el reino de los cielos: mas el que hiciere la voluntad de mi Padre que está en los cielos.
Muchos me dirán en aquel día: Señor, Señor, ¿no profetizamos en tu nombre, y en tu nombre lanzamos demonios, y en tu nombre hicimos muchos milagros?
Y entonces les protestaré: Nunca os conocí; apartaos de mí, obradores de maldad.
Cualquiera, pues, que me oye estas palabras, y las hace, le compararé á un hombre prudente, que edificó su casa sobre la peña;
Y descendió lluvia, y vinieron ríos, y soplaron vientos, y combatieron aquella casa; y no cayó: porque estaba fundada sobre la peña.
Y cualquiera que me oye estas palabras, y no las hace, le compararé á un hombre insensato, que edificó su casa sobre la arena;
Y descendió lluvia, y vinieron ríos, y soplaron vientos, é hicieron ímpetu en aquella casa; y cayó, y fué grande su ruina.
Y fué que, como Jesús acabó estas palabras, las gentes se admiraban de su doctrina;
Porque les enseñaba como quien tiene autoridad, y no como los escribas.
Y COMO descendió del monte, le seguían muchas gentes.
Y he aquí un leproso vino, y le adoraba, diciendo: Señor, si quisieres, puedes limpiarme.
Y extendiendo Jesús su mano, le tocó, diciendo: Quiero; sé limpio. Y luego su lepra fué limpiada.
Entonces Jesús le dijo: Mira, no lo digas á nadie; mas ve, muéstrate al sacerdote, y ofrece el presente que mandó Moisés, para testimonio á ellos.
Y entrando Jesús en Capernaum, vino á él un centurión, rogándole,
Y diciendo: Señor, mi mozo yace en casa paralítico, gravemente atormentado.
Y Jesús le dijo: Yo iré y le sanaré.
Y respondió el centurión, y dijo: Señor, no soy digno de que entres debajo de mi techado; mas solamente di la palabra, y mi mozo sanará.
Porque también yo soy hombre bajo de potestad, y tengo bajo de mí soldados: y digo á éste: Ve, y va; y al otro: Ven, y viene; y á mi siervo: Haz esto, y lo hace.
Y oyendo Jesús, se maravilló, y dijo á los que le seguían: De cierto os digo, que ni aun en Israel he hallado fe tanta.
Y os digo que vendrán muchos del oriente y del occidente, y se sentarán con Abraham, é Isaac, y Jacob, en el reino de los cielos:
Mas los hijos del reino serán echados á las tinieblas de afuera: allí será el lloro y el crujir de dientes.
Entonces Jesús dijo al centurión: Ve, y como creiste te sea hecho. Y su mozo fué sano en el mismo momento.
Y vino Jesús á casa de Pedro, y vió á su suegra echada en cama, y con fiebre.
Y tocó su mano, y la fiebre la dejó: y ella se levantó, y les servía.
Y como fué ya tarde, trajeron á él muchos endemoniados; y echó los demonios con la palabra, y sanó á todos los enfermos;
Para que se cumpliese lo que fué dicho por el profeta Isaías, que dijo: El mismo tomó nuestras enfermedades, y llevó nuestras dolencias.
Y viendo Jesús muchas gentes alrededor de sí, mandó pasar á la otra parte del lago.
Y llegándose un escriba, le dijo: Maestro, te seguiré á donde quiera que fueres.
Y Jesús le dijo: Las zorras tienen cavernas, y las aves del cielo nidos; mas el Hijo del hombre no tiene donde recueste su cabeza.
Y otro de sus discípulos le dijo: Señor, dame licencia para que vaya primero, y entierre á mi padre.
Y Jesús le dijo: Sígueme; deja que los muertos entierren á sus muertos.
Y entrando él en el barco, sus discípulos le siguieron.
Y he aquí, fué hecho en la mar un gran movimiento, que el barco se cubría de las ondas; mas él dormía.
Y llegándose sus discípulos, le despertaron, diciendo: Señor, sálvanos, que perecemos.
Y él les dice: ¿Por qué teméis, hombres de poca fe? Entonces, levantándose, reprendió á los vientos y á la mar; y fué grande bonanza.
Y los hombres se maravillaron, diciendo: ¿Qué hombre es éste, que aun los vientos y la mar le obedecen?
Y he aquí clamaron, diciendo: ¿Qué tenemos contigo, Jesús, Hijo de Dios? ¿has venido acá á molestarnos antes de tiempo?
Y estaba lejos de ellos un hato de muchos puercos paciendo.
Y los demonios le rogaron, diciendo: Si nos echas, permítenos ir á aquel hato de puercos.
Y les dijo: Id. Y ellos salieron, y se fueron á aquel hato de puercos: y he aquí, todo el hato de los puercos se precipitó de un despeñadero en la mar, y murieron en las aguas.
Y los porqueros huyeron, y viniendo á la ciudad, contaron todas las cosas, y lo que había pasado con los endemoniados.
Y he aquí, toda la ciudad salió á encontrar á Jesús: y cuando le vieron, le rogaban que saliese de sus términos.
ENTONCES entrando en el barco, pasó á la otra parte, y vino á su ciudad.
Y he aquí le trajeron un paralítico, echado en una cama: y viendo Jesús la fe de ellos, dijo al paralítico: Confía, hijo; tus pecados te son perdonados.
Y he aquí, algunos de los escribas decían dentro de sí: Este blasfema.
Y viendo Jesús sus pensamientos, dijo: ¿Por qué pensáis mal en vuestros corazones?
Porque, ¿qué es más fácil, decir: Los pecados te son perdonados; ó decir: Levántate, y anda?
Pues para que sepáis que el Hijo del hombre tiene potestad en la tierra de perdonar pecados, (dice entonces al paralítico): Levántate, toma tu cama, y vete á tu casa.
Entonces él se levantó y se fué á su casa.
Y las gentes, viéndolo, se maravillaron, y glorificaron á Dios, que había dado tal potestad á los hombres.
Y pasando Jesús de allí, vió á un hombre que estaba sentado al banco de los públicos tributos, el cual se llamaba Mateo; y dícele: Sígueme. Y se levantó, y le siguió.
Y aconteció que estando él sentado á la mesa en casa, he aquí que muchos publicanos y pecadores, que habían venido, se sentaron juntamente á la mesa con Jesús y sus discípulos.
Y viendo esto los Fariseos, dijeron á sus discípulos: ¿Por qué come vuestro Maestro con los publicanos y pecadores?
Y oyéndolo Jesús, les dijo: Los que están sanos no tienen necesidad de médico, sino los enfermos.
Andad pues, y aprended qué cosa es: Misericordia quiero, y no sacrificio: porque no he venido á llamar justos, sino pecadores á arrepentimiento.
Entonces los discípulos de Juan vienen á él, diciendo: ¿Por qué nosotros y los Fariseos ayunamos muchas veces, y tus discípulos no ayunan?
Y Jesús les dijo: ¿Pueden los que son de bodas tener luto entre tanto que el esposo está con ellos? mas vendrán días cuando el esposo será quitado de ellos, y entonces ayunarán.
Y nadie echa remiendo de paño recio en vestido viejo; porque el tal remiendo tira del vestido, y se hace peor la rotura.
Hablando él estas cosas á ellos, he aquí vino un principal, y le adoraba, diciendo: Mi hija es muerta poco ha: mas ven y pon tu mano sobre ella, y vivirá.
Y se levantó Jesús, y le siguió, y sus discípulos.
Y he aquí una mujer enferma de flujo de sangre doce años había, llegándose por detrás, tocó la franja de su vestido:
Porque decía entre sí: Si tocare solamente su vestido, seré salva.
Mas Jesús volviéndose, y mirándola, dijo: Confía, hija, tu fe te ha salvado. Y la mujer fué salva desde aquella hora.
Y llegado Jesús á casa del principal, viendo los tañedores de flautas, y la gente que hacía bullicio,
Díceles: Apartaos, que la muchacha no es muerta, mas duerme. Y se burlaban de él.
Y como la gente fué echada fuera, entró, y tomóla de la mano, y se levantó la muchacha.
Y salió esta fama por toda aquella tierra.
Y pasando Jesús de allí, le siguieron dos ciegos, dando voces y diciendo: Ten misericordia de nosotros, Hijo de David.
Y llegado á la casa, vinieron á él los ciegos; y Jesús les dice: ¿Creéis que puedo hacer esto? Ellos dicen: Sí, Señor.
Entonces tocó los ojos de ellos, diciendo: Conforme á vuestra fe os sea hecho.
Y los ojos de ellos fueron abiertos. Y Jesús les encargó rigurosamente, diciendo: Mirad que nadie lo sepa.
Mas ellos salidos, divulgaron su fama por toda aquella tierra.
Y saliendo ellos, he aquí, le trajeron un hombre mudo, endemoniado.
Y echado fuera el demonio, el mudo habló; y las gentes se maravillaron, diciendo: Nunca ha sido vista cosa semejante en Israel.
Mas los Fariseos decían: Por el príncipe de los demonios echa fuera los demonios.
Y rodeaba Jesús por todas las ciudades y aldeas, enseñando en las sinagogas de ellos, y predicando el evangelio del reino, y sanando toda enfermedad y todo achaque en el pueblo.
Y viendo las gentes, tuvo compasión de ellas; porque estaban derramadas y esparcidas como ovejas que no tienen pastor.
Entonces dice á sus discípulos: A la verdad la mies es mucha, mas los obreros pocos.
Rogad, pues, al Señor de la mies, que envíe obreros á su mies.
ENTONCES llamando á sus doce discípulos, les dió potestad contra los espíritus inmundos, para que los echasen fuera, y sanasen toda enfermedad y toda dolencia.
Y los nombres de los doce apóstoles son estos: el primero, Simón, que es dicho Pedro, y Andrés su hermano; Jacobo, hijode Zebedeo, y Juan su hermano;
Felipe, y Bartolomé; Tomás, y Mateo el publicano; Jacobohijode Alfeo, y Lebeo, por sobrenombre Tadeo;
Simón el Cananita y Judas Iscariote, que también le entregó.
A estos doce envió Jesús, á los cuales dió mandamiento, diciendo: Por el camino de los Gentiles no iréis, y en ciudad de Samaritanos no entréis;
Mas id antes á las ovejas perdidas de la casa de Israel.
Y yendo, predicad, diciendo: El reino de los cielos se ha acercado.
Sanad enfermos, limpiad leprosos, resucitad muertos, echad fuera demonios: de gracia recibisteis, dad de gracia.
No aprestéis oro, ni plata, ni cobre en vuestras bolsas;
Ni alforja para el camino, ni dos ropas de vestir, ni zapatos, ni bordón; porque el obrero digno es de su alimento.
Mas en cualquier ciudad, ó aldea donde entrareis, investigad quién sea en ella digno, y reposad allí hasta que salgáis.
Y entrando en la casa, saludadla.
Y si la casa fuere digna, vuestra paz vendrá sobre ella; mas si no fuere digna, vuestra paz se volverá á vosotros.
Y cualquiera que no os recibiere, ni oyere vuestras palabras, salid de aquella casa ó ciudad, y sacudid el polvo de vuestros pies.
De cierto os digo, que el castigoserá más tolerable á la tierra de los de Sodoma y de los de Gomorra en el día del juicio, que á aquella ciudad.
He aquí, yo os envío como á ovejas en medio de lobos: sed pues prudentes como serpientes, y sencillos como palomas.
Y guardaos de los hombres: porque os entregarán en concilios, y en sus sinagogas os azotarán;
Y aun á príncipes y á reyes seréis llevados por causa de mí, por testimonio á ellos y á los Gentiles.
Mas cuando os entregaren, no os apuréis por cómo ó qué hablaréis; porque en aquella hora os será dado qué habéis de hablar.
Porque no sois vosotros los que habláis, sino el Espíritu de vuestro Padre que habla en vosotros.
Y el hermano entregará al hermano á la muerte, y el padre al hijo; y los hijos se levantarán contra los padres, y los harán morir.
Y seréis aborrecidos de todos por mi nombre; mas el que soportare hasta el fin, éste será salvo.
Mas cuando os persiguieren en esta ciudad, huid á la otra: porque de cierto os digo, queno acabaréis de andar todas las ciudades de Israel, que no venga el Hijo del hombre.
El discípulo no es más que su maestro, ni el siervo más que su señor.
Bástale al discípulo ser como su maestro, y al siervo como su señor. Si al padre de la familia llamaron Beelzebub, ¿cuánto más á los de su casa?
Así que, no los temáis; porque nada hay encubierto, que no haya de ser manifestado; ni oculto, que no haya de saberse.
Lo que os digo en tinieblas, decidlo en la luz; y lo que oís al oído predicadlo desde los terrados.
Y no temáis á los que matan el cuerpo, mas al alma no pueden matar: temed antes á aquel que puede destruir el alma y el cuerpo en el infierno.
¿No se venden dos pajarillos por un cuarto? Con todo, ni uno de ellos cae á tierra sin vuestro Padre.
Pues aun vuestros cabellos están todos contados.
Así que, no temáis: más valéis vosotros que muchos pajarillos.
Cualquiera pues, que me confesare delante de los hombres, le confesaré yo también delante de mi Padre que está en los cielos.
Y cualquiera que me negare delante de los hombres, le negaré yo también delante de mi Padre que está en los cielos.
No penséis que he venido para meter paz en la tierra: no he venido para meter paz, sino espada.
Porque he venido para hacer disensión del hombre contra su padre, y de la hija contra su madre, y de la nuera contra su suegra.
Y los enemigos del hombre serán los de su casa.
El que ama padre ó madre más que á mí, no es digno de mí; y el que ama hijo ó hija más que á mí, no es digno de mí.
Y el que no toma su cruz, y sigue en pos de mí, no es digno de mí.
El que hallare su vida, la perderá; y el que perdiere su vida por causa de mí, la hallará.
El que os recibe á vosotros, á mí recibe; y el que á mí recibe, recibe al que me envió.
El que recibe profeta en nombre de profeta, merced de profeta recibirá; y el que recibe justo en nombre de justo, merced de justo recibirá.
Y cualquiera que diere á uno de estos pequeñitos un vaso de agua fría solamente, en nombre de discípulo, de cierto os digo, que no perderá su recompensa.
Y FUÉ, que acabando Jesús de dar mandamientos á sus doce discípulos, se fué de allí á enseñar y á predicar en las ciudades de ellos.
Y oyendo Juan en la prisión los hechos de Cristo, le envió dos de sus discípulos,
Diciendo: ¿Eres tú aquél que había de venir, ó esperaremos á otro?
Y respondiendo Jesús, les dijo: Id, y haced saber á Juan las cosas que oís y veis:
Los ciegos ven, y los cojos andan; los leprosos son limpiados, y los sordos oyen; los muertos son resucitados, y á los pobres es anunciado el evangelio.
Y bienaventurado es el que no fuere escandalizado en mí.
E idos ellos, comenzó Jesús á decir de Juan á las gentes: ¿Qué salisteis á ver al desierto? ¿una caña que es meneada del viento?
Mas ¿qué salisteis á ver? ¿un hombre cubierto de delicados vestidos? He aquí, los que traen vestidos delicados, en las casas de los reyes están.
Mas ¿qué salisteis á ver? ¿un profeta? También os digo, y más que profeta.
Porque éste es de quien está escrito: He aquí, yo envío mi mensajero delante de tu faz, que aparejará tu camino delante de ti.
De cierto os digo, que no se levantó entre los que nacen de mujeres otro mayor que Juan el Bautista; mas el que es muy más pequeño en el reino de los cielos, mayor es que él.
Desde los días de Juan el Bautista hasta ahora, al reino de los cielos se hace fuerza, y los valientes lo arrebatan.
Porque todos los profetas y la ley hasta Juan profetizaron.
Y si queréis recibir, él es aquel Elías que había de venir.
El que tiene oídos para oir, oiga.
Mas ¿á quién compararé esta generación? Es semejante á los muchachos que se sientan en las plazas, y dan voces á sus compañeros,
Y dicen: Os tañimos flauta, y no bailasteis; os endechamos, y no lamentasteis.
Porque vino Juan, que ni comía ni bebía, y dicen: Demonio tiene.
Vino el Hijo del hombre, que come y bebe, y dicen: He aquí un hombre comilón, y bebedor de vino, amigo de publicanos y de pecadores. Mas la sabiduría es justificada por sus hijos.
Entonces comenzó á reconvenir á las ciudades en las cuales habían sido hechas muy muchas de sus maravillas, porque no se habían arrepentido, diciendo:
¡Ay de ti, Corazín! ¡Ay de ti, Bethsaida! porque si en Tiro y en Sidón fueran hechas las maravillas que han sido hechas en vosotras, en otro tiempo se hubieran arrepentido en saco y en ceniza.
Por tanto os digo, que á Tiro y á Sidón será más tolerable el castigo en el día del juicio, que á vosotras.
Por tanto os digo, que á la tierra de los de Sodoma será más tolerable el castigo en el día del juicio, que á ti.
En aquel tiempo, respondiendo Jesús, dijo: Te alabo, Padre, Señor del cielo y de la tierra, que hayas escondido estas cosas de los sabios y de los entendidos, y las hayas revelado á los niños.
Así, Padre, pues que así agradó en tus ojos.
Todas las cosas me son entregadas de mi Padre: y nadie conoció al Hijo, sino el Padre; ni al Padre conoció alguno, sino el Hijo, y aquel á quien el Hijo lo quisiere revelar.
Venid á mí todos los que estáis trabajados y cargados, que yo os haré descansar.
Llevad mi yugo sobre vosotros, y aprended de mí, que soy manso y humilde de corazón; y hallaréis descanso para vuestras almas.
Porque mi yugo es fácil, y ligera mi carga.
EN aquel tiempo iba Jesús por los sembrados en sábado; y sus discípulos tenían hambre, y comenzaron á coger espigas, y á comer.
Y viéndolo los Fariseos, le dijeron: He aquí tus discípulos hacen lo que no es lícito hacer en sábado.
Y él les dijo: ¿No habéis leído qué hizo David, teniendo él hambre y los que con él estaban:
Cómo entró en la casa de Dios, y comió los panes de la proposición, que no le era lícito comer, ni á los que estaban con él, sino á solos los sacerdotes?
O ¿no habéis leído en la ley, que los sábados en el templo los sacerdotes profanan el sábado, y son sin culpa?
Pues os digo que uno mayor que el templo está aquí.
Mas si supieseis qué es: Misericordia quiero y no sacrificio, no condenaríais á los inocentes:
Porque Señor es del sábado el Hijo del hombre.
Y partiéndose de allí, vino á la sinagoga de ellos.
Y he aquí había allí uno que tenía una mano seca: y le preguntaron, diciendo: ¿Es lícito curar en sábado? por acusarle.
Y él les dijo: ¿Qué hombre habrá de vosotros, que tenga una oveja, y si cayere ésta en una fosa en sábado, no le eche mano, y la levante?
Pues ¿cuánto más vale un hombre que una oveja? Así que, lícito es en los sábados hacer bien.
Entonces dijo á aquel hombre: Extiende tu mano. Y él la extendió, y fué restituída sana como la otra.
Y salidos los Fariseos, consultaron contra él para destruirle.
Mas sabiéndolo Jesús, se apartó de allí: y le siguieron muchas gentes, y sanaba á todos.
Y él les encargaba eficazmente que no le descubriesen:
Para que se cumpliese lo que estaba dicho por el profeta Isaías, que dijo:
He aquí mi siervo, al cual he escogido; mi Amado, en el cual se agrada mi alma: pondré mi Espíritu sobre él, y á los Gentiles anunciará juicio.
No contenderá, ni voceará: ni nadie oirá en las calles su voz.
La caña cascada no quebrará, y el pábilo que humea no apagará, hasta que saque á victoria el juicio.
Y en su nombre esperarán los Gentiles.
Entonces fué traído á él un endemoniado, ciego y mudo, y le sanó; de tal manera, que el ciego y mudo hablaba y veía.
Y todas las gentes estaban atónitas, y decían: ¿Será éste aquel Hijo de David?
Mas los Fariseos, oyéndolo, decían: Este no echa fuera los demonios, sino por Beelzebub, príncipe de los demonios.
Y Jesús, como sabía los pensamientos de ellos, les dijo: Todo reino dividido contra sí mismo, es desolado; y toda ciudad ó casa dividida contra sí misma, no permanecerá.
Y si Satanás echa fuera á Satanás, contra sí mismo está dividido; ¿cómo, pues, permanecerá su reino?
Y si yo por Beelzebub echo fuera los demonios, ¿vuestros hijos por quién los echan? Por tanto, ellos serán vuestros jueces.
Y si por espíritu de Dios yo echo fuera los demonios, ciertamente ha llegado á vosotros el reino de Dios.
Porque, ¿cómo puede alguno entrar en la casa del valiente, y saquear sus alhajas, si primero no prendiere al valiente? y entonces saqueará su casa.
El que no es conmigo, contra mí es; y el que conmigo no recoge, derrama.
Por tanto os digo: Todo pecado y blasfemia será perdonado á los hombres: mas la blasfemia contra el Espíritu no será perdonada á los hombres.
Y cualquiera que hablare contra el Hijo del hombre, le será perdonado: mas cualquiera que hablare contra el Espíritu Santo, no le será perdonado, ni en este siglo, ni en el venidero.
O haced el árbol bueno, y su fruto bueno, ó haced el árbol corrompido, y su fruto dañado; porque por el fruto es conocido el árbol.
Generación de víboras, ¿cómo podéis hablar bien, siendo malos? porque de la abundancia del corazón habla la boca.
El hombre bueno del buen tesoro del corazón saca buenas cosas: y el hombre malo del mal tesoro saca malas cosas.
Mas yo os digo, que toda palabra ociosa que hablaren los hombres, de ella darán cuenta en el día del juicio.
Porque por tus palabras serás justificado, y por tus palabras serás condenado.
Entonces respondieron algunos de los escribas y de los Fariseos, diciendo: Maestro, deseamos ver de ti señal.
Y él respondió, y les dijo: La generación mala y adulterina demanda señal; mas señal no le será dada, sino la señal de Jonás profeta.
Porque como estuvo Jonás en el vientre de la ballena tres días y tres noches, así estará el Hijo del hombre en el corazón de la tierra tres días y tres noches.
Los hombres de Nínive se levantarán en el juicio con esta generación, y la condenarán; porque ellos se arrepintieron á la predicación de Jonás; y he aquí más que Jonás en este lugar.
Cuando el espíritu inmundo ha salido del hombre, anda por lugares secos, buscando reposo, y no lo halla.
Entonces dice: Me volveré á mi casa de donde salí: y cuando viene, la halla desocupada, barrida y adornada.
Y estando él aún hablando á las gentes, he aquí su madre y sus hermanos estaban fuera, que le querían hablar.
Y le dijo uno: He aquí tu madre y tus hermanos están fuera, que te quieren hablar.
Y respondiendo él al que le decía esto, dijo: ¿Quién es mi madre y quiénes son mis hermanos?
Y extendiendo su mano hacia sus discípulos, dijo: He aquí mi madre y mis hermanos.
Porque todo aquel que hiciere la voluntad de mi Padre que está en los cielos, ese es mi hermano, y hermana, y madre.
Y AQUEL día, saliendo Jesús de casa, se sentó junto á la mar.
Y se allegaron á él muchas gentes; y entrándose él en el barco, se sentó, y toda la gente estaba á la ribera.
Y les habló muchas cosas por parábolas, diciendo: He aquí el que sembraba salió á sembrar.
Y sembrando, partede la simientecayó junto al camino; y vinieron las aves, y la comieron.
Y parte cayó en pedregales, donde no tenía mucha tierra; y nació luego, porque no tenía profundidad de tierra:
Mas en saliendo el sol, se quemó; y secóse, porque no tenía raíz.
Y parte cayó en espinas; y las espinas crecieron, y la ahogaron.
Y parte cayó en buena tierra, y dió fruto, cuál á ciento, cuál á sesenta, y cuál á treinta.
Quien tiene oídos para oir, oiga.
Entonces, llegándose los discípulos, le dijeron: ¿Por qué les hablas por parábolas?
Y él respondiendo, les dijo: Por que á vosotros es concedido saber los misterios del reino de los cielos; mas á ellos no es concedido.
Porque á cualquiera que tiene, se le dará, y tendrá más; pero al que no tiene, aun lo que tiene le será quitado.
Por eso les hablo por parábolas; porque viendo no ven, y oyendo no oyen, ni entienden.
De manera que se cumple en ellos la profecía de Isaías, que dice: De oído oiréis, y no entenderéis; y viendo veréis, y no miraréis.
Mas bienaventurados vuestros ojos, porque ven; y vuestros oídos, porque oyen.
Porque de cierto os digo, que muchos profetas y justos desearon ver lo que veis, y no lo vieron: y oir lo que oís, y no lo oyeron.
Oid, pues, vosotros la parábola del que siembra:
Oyendo cualquiera la palabra del reino, y no entendiéndola, viene el malo, y arrebata lo que fué sembrado en su corazón: éste es el que fué sembrado junto al camino.
Y el que fué sembrado en pedregales, éste es el que oye la palabra, y luego la recibe con gozo.
Mas no tiene raíz en sí, antes es temporal: que venida la aflicción ó la persecución por la palabra, luego se ofende.
Y el que fué sembrado en espinas, éste es el que oye la palabra; pero el afán de este siglo y el engaño de las riquezas, ahogan la palabra, y hácese infructuosa.
Mas el que fué sembrado en buena tierra, éste es el que oye y entiende la palabra, y el que lleva fruto: y lleva uno á ciento, y otro á sesenta, y otro á treinta.
Otra parábola les propuso, diciendo: El reino de los cielos es semejante al hombre que siembra buena simiente en su campo:
Mas durmiendo los hombres, vino su enemigo, y sembró cizaña entre el trigo, y se fué.
Y como la hierba salió é hizo fruto, entonces apareció también la cizaña.
Y llegándose los siervos del padre de la familia, le dijeron: Señor, ¿no sembraste buena simiente en tu campo? ¿de dónde, pues, tiene cizaña?
Y él les dijo: Un hombre enemigo ha hecho esto. Y los siervos le dijeron: ¿Quieres, pues, que vayamos y la cojamos?
Y él dijo: No; porque cogiendo la cizaña, no arranquéis también con ella el trigo.
Otra parábola les propuso, diciendo: El reino de los cielos es semejante al grano de mostaza, que tomándolo alguno lo sembró en su campo:
El cual á la verdad es la más pequeña de todas las simientes; mas cuando ha crecido, es la mayor de las hortalizas, y se hace árbol, que vienen las aves del cielo y hacen nidos en sus ramas.
Otra parábola les dijo: El reino de los cielos es semejante á la levadura que tomó una mujer, y escondió en tres medidas de harina, hasta que todo quedó leudo.
Todo esto habló Jesús por parábolas á las gentes, y sin parábolas no les hablaba:
Para que se cumpliese lo que fué dicho por el profeta, que dijo: Abriré en parábolas mi boca; rebosaré cosas escondidas desde la fundación del mundo.
Entonces, despedidas las gentes, Jesús se vino á casa; y llegándose á él sus discípulos, le dijeron: Decláranos la parábola de la cizaña del campo.
Y respondiendo él, les dijo: El que siembra la buena simiente es el Hijo del hombre;
Y el campo es el mundo; y la buena simiente son los hijos del reino, y la cizaña son los hijos del malo;
Y el enemigo que la sembró, es el diablo; y la siega es el fin del mundo, y los segadores son los ángeles.
De manera que como es cogida la cizaña, y quemada al fuego, así será en el fin de este siglo.
Enviará el Hijo del hombre sus ángeles, y cogerán de su reino todos los escándalos, y los que hacen iniquidad,
Y los echarán en el horno de fuego: allí será el lloro y el crujir de dientes.
Entonces los justos resplandecerán como el sol en el reino de su Padre: el que tiene oídos para oir, oiga.
Además, el reino de los cielos es semejante al tesoro escondido en el campo; el cual hallado, el hombre lo encubre, y de gozo de ello va, y vende todo lo que tiene, y compra aquel campo.
También el reino de los cielos es semejante al hombre tratante, que busca buenas perlas;
Que hallando una preciosa perla, fué y vendió todo lo que tenía, y la compró.
Asimismo el reino de los cielos es semejante á la red, que echada en la mar, coge de todas suertes de peces:
La cual estando llena, la sacaron á la orilla; y sentados, cogieron lo bueno en vasos, y lo malo echaron fuera.
Así será al fin del siglo: saldrán los ángeles, y apartarán á los malos de entre los justos,
Y los echarán en el horno del fuego: allí será el lloro y el crujir de dientes.
Díceles Jesús: ¿Habéis entendido todas estas cosas? Ellos responden: Sí, Señor.
Y él les dijo: Por eso todo escriba docto en el reino de los cielos, es semejante á un padre de familia, que saca de su tesoro cosas nuevas y cosas viejas.
Y aconteció que acabando Jesús estas parábolas, pasó de allí.
Y venido á su tierra, les enseñaba en la sinagoga de ellos, de tal manera que ellos estaban atónitos, y decían: ¿De dónde tiene éste esta sabiduría, y estas maravillas?
¿No es éste el hijo del carpintero? ¿no se llama su madre María, y sus hermanos Jacobo y José, y Simón, y Judas?
¿Y no están todas sus hermanas con nosotros? ¿De dónde, pues, tiene éste todas estas cosas?
Y se escandalizaban en él. Mas Jesús les dijo: No hay profeta sin honra sino en su tierra y en su casa.
Y no hizo allí muchas maravillas, á causa de la incredulidad de ellos.
EN aquel tiempo Herodes el tetrarca oyó la fama de Jesús,
Y dijo á sus criados: Este es Juan el Bautista: él ha resucitado de los muertos, y por eso virtudes obran en él.
Porque Herodes había prendido á Juan, y le había aprisionado y puesto en la cárcel, por causa de Herodías, mujer de Felipe su hermano;
Porque Juan le decía: No te es lícito tenerla.
Y quería matarle, mas temía al pueblo; porque le tenían como á profeta.
Mas celebrándose el día del nacimiento de Herodes, la hija de Herodías danzó en medio, y agradó á Herodes.
Y prometió él con juramento de darle todo lo que pidiese.
Y ella, instruída primero de su madre, dijo: Dame aquí en un plato la cabeza de Juan el Bautista.
Entonces el rey se entristeció; mas por el juramento, y por los que estaban juntamente á la mesa, mandó que se le diese.
Y enviando, degolló á Juan en la cárcel.
Y fué traída su cabeza en un plato, y dada á la muchacha; y ella la presentó á su madre.
Entonces llegaron sus discípulos, y tomaron el cuerpo, y lo enterraron; y fueron, y dieron las nuevas á Jesús.
Y oyéndoloJesús, se apartó de allí en un barco á un lugar descierto, apartado: y cuando las genteslooyeron, le siguieron á pie de las ciudades.
Y saliendo Jesús, vió un gran gentío, y tuvo compasión de ellos, y sanó á los que de ellos había enfermos.
Y Jesús les dijo: No tienen necesidad de irse: dadles vosotros de comer.
Y ellos dijeron: No tenemos aquí sino cinco panes y dos peces.
Y él les dijo: Traédmelos acá.
Y comieron todos, y se hartaron; y alzaron lo que sobró de los pedazos, doce cestas llenas.
Y los que comieron fueron como cinco mil hombres, sin las mujeres y los niños.
Y luego Jesús hizo á sus discípulos entrar en el barco, é ir delante de él á la otra parte del lago, entre tanto que él despedía á las gentes.
Y despedidas las gentes, subió al monte, apartado, á orar: y como fué la tarde del día, estaba allí solo.
Y ya el barco estaba en medio de la mar, atormentado de las ondas; porque el viento era contrario.
Mas á la cuarta vela de la noche, Jesús fué á ellos andando sobre la mar.
Y los discípulos, viéndole andar sobre la mar, se turbaron, diciendo: Fantasma es. Y dieron voces de miedo.
Mas luego Jesús les habló, diciendo: Confiad, yo soy; no tengáis miedo.
Entonces le respondió Pedro, y dijo: Señor, si tú eres, manda que yo vaya á ti sobre las aguas.
Y él dijo: Ven. Y descendiendo Pedro del barco, andaba sobre las aguas para ir á Jesús.
Mas viendo el viento fuerte, tuvo miedo; y comenzándose á hundir, dió voces, diciendo: Señor, sálvame.
Y luego Jesús, extendiendo la mano, trabó de él, y le dice: Oh hombre de poca fe, ¿por qué dudaste?
Y como ellos entraron en el barco, sosegóse el viento.
Entonces los que estaban en el barco, vinieron y le adoraron, diciendo: Verdaderamente eres Hijo de Dios.
Y llegando á la otra parte, vinieron á la tierra de Genezaret.
Y como le conocieron los hombres de aquel lugar, enviaron por toda aquella tierra alrededor, y trajeron á él todos los enfermos;
Y le rogaban que solamente tocasen el borde de su manto; y todos los que tocaron, quedaron sanos.
ENTONCES llegaron á Jesús ciertos escribas y Fariseos de Jerusalem, diciendo:
¿Por qué tus discípulos traspasan la tradición de los ancianos? porque no se lavan las manos cuando comen pan.
Y él respondiendo, les dijo: ¿Por qué también vosotros traspasáis el mandamiento de Dios por vuestra tradición?
Porque Dios mandó, diciendo: Honra al padre y á la madre, y, El que maldijere al padre ó á la madre, muera de muerte.
Mas vosotros decís: Cualquiera que dijere al padre ó á la madre: Es ya ofrenda mía á Dios todo aquello con que pudiera valerte;
No deberá honrar á su padre ó á su madre con socorro. Así habéis invalidado el mandamiento de Dios por vuestra tradición.
Hipócritas, bien profetizó de vosotros Isaías, diciendo:
Este pueblo de labios me honra; mas su corazón lejos está de mí.
Mas en vano me honran, enseñando doctrinas y mandamientos de hombres.
Y llamando á sí las gentes, les dijo: Oid, y entended:
No lo que entra en la boca contamina al hombre; mas lo que sale de la boca, esto contamina al hombre.
Entonces llegándose sus discípulos, le dijeron: ¿Sabes que los Fariseos oyendo esta palabra se ofendieron?
Mas respondiendo él, dijo: Toda planta que no plantó mi Padre celestial, será desarraigada.
Dejadlos: son ciegos guías de ciegos; y si el ciego guiare al ciego, ambos caerán en el hoyo.
Y respondiendo Pedro, le dijo: Decláranos esta parábola.
Y Jesús dijo: ¿Aun también vosotros sois sin entendimiento?
¿No entendéis aún, que todo lo que entra en la boca, va al vientre, y es echado en la letrina?
Mas lo que sale de la boca, del corazón sale; y esto contamina al hombre.
Porque del corazón salen los malos pensamientos, muertes, adulterios, fornicaciones, hurtos, falsos testimonios, blasfemias.
Estas cosas son las que contaminan al hombre: que comer con las manos por lavar no contamina al hombre.
Y saliendo Jesús de allí, se fué á las partes de Tiro y de Sidón.
Y he aquí una mujer Cananea, que había salido de aquellos términos, clamaba, diciéndole: Señor, Hijo de David, ten misericordia de mí; mi hija es malamente atormentada del demonio.
Mas él no le respondió palabra. Entonces llegándose sus discípulos, le rogaron, diciendo: Despáchala, pues da voces tras nosotros.
Y él respondiendo, dijo: No soy enviado sino á las ovejas perdidas de la casa de Israel.
Entonces ella vino, y le adoró, diciendo: Señor, socórreme.
Y respondiendo él, dijo: No es bien tomar el pan de los hijos, y echarlo á los perrillos.
Y ella dijo: Sí, Señor; mas los perrillos comen de las migajas que caen de la mesa de sus señores.
Entonces respondiendo Jesús, dijo: Oh mujer, grande es tu fe; sea hecho contigo como quieres. Y fué sana su hija desde aquella hora.
Y partido Jesús de allí, vino junto al mar de Galilea: y subiendo al monte, se sentó allí.
Y llegaron á él muchas gentes, que tenían consigo cojos, ciegos, mudos, mancos, y otros muchos enfermos: y los echaron á los pies de Jesús, y los sanó:
De manera que se maravillaban las gentes, viendo hablar los mudos, los mancos sanos, andar los cojos, y ver los ciegos: y glorificaron al Dios de Israel.
Entonces sus discípulos le dicen: ¿Dónde tenemos nosotros tantos panes en el desierto, que hartemos á tan gran compañía?
Y Jesús les dice: ¿Cuántos panes tenéis? Y ellos dijeron: Siete, y unos pocos pececillos.
Y mandó á las gentes que se recostasen sobre la tierra.
Y tomando los siete panes y los peces, haciendo gracias, partió y dió á sus discípulos; y los discípulos á la gente.
Y comieron todos, y se hartaron: y alzaron lo que sobró de los pedazos, siete espuertas llenas.
Y eran los que habían comido, cuatro mil hombres, sin las mujeres y los niños.
Entonces, despedidas las gentes, subió en el barco: y vino á los términos de Magdalá.
Y LLEGÁNDOSE los Fariseos y los Saduceos para tentarle, le pedían que les mostrase señal del cielo.
Mas él respondiendo, les dijo: Cuando es la tarde del día, decís: Sereno; porque el cielo tiene arreboles.
Y á la mañana: Hoy tempestad; porque tiene arreboles el cielo triste. Hipócritas, que sabéis hacer diferencia en la faz del cielo; ¿y en las señales de los tiempos no podéis?
La generación mala y adulterina demanda señal; mas señal no le será dada, sino la señal de Jonás profeta. Y dejándolos, se fué.
Y viniendo sus discípulos de la otra parte del lago, se habían olvidado de tomar pan.
Y Jesús les dijo: Mirad, y guardaos de la levadura de los Fariseos y de los Saduceos.
Y ellos pensaban dentro de sí, diciendo: Esto dice porque no tomamos pan.
Y entendiéndolo Jesús, les dijo: ¿Por qué pensáis dentro de vosotros, hombres de poca fe, que no tomasteis pan?
¿No entendéis aún, ni os acordáis de los cinco panes entre cinco mil hombres, y cuántos cestos alzasteis?
¿Ni de los siete panes entre cuatro mil, y cuántas espuertas tomasteis?
¿Cómo es que no entendéis que no por el pan os dije, que os guardaseis de la levadura de los Fariseos y de los Saduceos?
Entonces entendieron que no les había dicho que se guardasen de la levadura de pan, sino de la doctrina de los Fariseos y de los Saduceos.
Y viniendo Jesús á las partes de Cesarea de Filipo, preguntó á sus discípulos, diciendo: ¿Quién dicen los hombres que es el Hijo del hombre?
Y ellos dijeron: Unos, Juan el Bautista; y otros, Elías; y otros, Jeremías, ó alguno de los profetas.
El les dice: Y vosotros, ¿quién decís que soy?
Y respondiendo Simón Pedro, dijo: Tú eres el Cristo, el Hijo del Dios viviente.
Entonces, respondiendo Jesús, le dijo: Bienaventurado eres, Simón, hijo de Jonás; porque no te lo reveló carne ni sangre, mas mi Padre que está en los cielos.
Mas yo también te digo, que tú eres Pedro, y sobre esta piedra edificaré mi iglesia; y las puertas del infierno no prevalecerán contra ella.
Y á ti daré las llaves del reino de los cielos; y todo lo que ligares en la tierra será ligado en los cielos; y todo lo que desatares en la tierra será desatado en los cielos.
Entonces mandó á sus discípulos que á nadie dijesen que él era Jesús el Cristo.
Y Pedro, tomándolo aparte, comenzó á reprenderle, diciendo: Señor, ten compasión de ti: en ninguna manera esto te acontezca.
Entonces él, volviéndose, dijo á Pedro: Quítate de delante de mí, Satanás; me eres escándalo; porque no entiendes lo que es de Dios sino lo que es de los hombres.
Entonces Jesús dijo á sus discípulos: Si alguno quiere venir en pos de mí, niéguese á sí mismo, y tome su cruz, y sígame.
Porque cualquiera que quisiere salvar su vida, la perderá, y cualquiera que perdiere su vida por causa de mí, la hallará.
Porque ¿de qué aprovecha al hombre, si granjeare todo el mundo, y perdiere su alma? O ¿qué recompensa dará el hombre por su alma?
Porque el Hijo del hombre vendrá en la gloria de su Padre con sus ángeles, y entonces pagará á cada uno conforme á sus obras.
De cierto os digo: hay algunos de los que están aquí, que no gustarán la muerte, hasta que hayan visto al Hijo del hombre viniendo en su reino.
Y DESPUÉS de seis días, Jesús toma á Pedro, y á Jacobo, y á Juan su hermano, y los lleva aparte á un monte alto:
Y se transfiguró delante de ellos; y resplandeció su rostro como el sol, y sus vestidos fueron blancos como la luz.
Y he aquí les aparecieron Moisés y Elías, hablando con él.
Y respondiendo Pedro, dijo á Jesús: Señor, bien es que nos quedemos aquí: si quieres, hagamos aquí tres pabellones: para ti uno, y para Moisés otro, y otro para Elías.
Y estando aún él hablando, he aquí una nube de luzquelos cubrió; y he aquí una voz de la nube, que dijo: Este es mi Hijo amado, en el cual tomo contentamiento: á él oid.
Y oyendo esto los discípulos, cayeron sobre sus rostros, y temieron en gran manera.
Entonces Jesús llegando, los tocó, y dijo: Levantaos, y no temáis.
Y alzando ellos sus ojos, á nadie vieron, sino á solo Jesús.
Y como descendieron del monte, les mandó Jesús, diciendo: No digáis á nadie la visión, hasta que el Hijo del hombre resucite de los muertos.
Entonces sus discípulos le preguntaron, diciendo: ¿Por qué dicen pues los escribas que es menester que Elías venga primero?
Y respondiendo Jesús, les dijo: A la verdad, Elías vendrá primero, y restituirá todas las cosas.
Mas os digo, que ya vino Elías, y no le conocieron; antes hicieron en él todo lo que quisieron: así también el Hijo del hombre padecerá de ellos.
Los discípulos entonces entendieron, que les habló de Juan el Bautista.
Y como ellos llegaron al gentío, vino á él un hombre hincándosele de rodillas,
Y diciendo: Señor, ten misericordia de mi hijo, que es lunático, y padece malamente; porque muchas veces cae en el fuego, y muchas en el agua.
Y le he presentado á tus discípulos, y no le han podido sanar.
Y respondiendo Jesús, dijo: ¡Oh generación infiel y torcida! ¿hasta cuándo tengo de estar con vosotros? ¿hasta cuándo os tengo de sufrir? traédmele acá.
Y Jesús le reprendió, y salió el demonio de él; y el mozo fué sano desde aquella hora.
Entonces, llegándose los discípulos á Jesús, aparte, dijeron: ¿Por qué nosotros no lo pudimos echar fuera?
Mas este linaje no sale sino por oración y ayuno.
Y estando ellos en Galilea, Jesús les dijo: El Hijo del hombre será entregado en manos de hombres,
Y le matarán; mas al tercer día resucitará. Y ellos se entristecieron en gran manera.
Y como llegaron á Capernaum, vinieron á Pedro los que cobraban las dos dracmas, y dijeron: ¿Vuestro Maestro no paga las dos dracmas?
Pedro le dice: De los extraños. Jesús le dijo: Luego los hijos son francos.
EN aquel tiempo se llegaron los discípulos á Jesús, diciendo: ¿Quién es el mayor en el reino de los cielos?
Y llamando Jesús á un niño, le puso en medio de ellos,
Y dijo: De cierto os digo, que si no os volviereis, y fuereis como niños, no entraréis en el reino de los cielos.
Así que, cualquiera que se humillare como este niño, éste es el mayor en el reino de los cielos.
Y cualquiera que recibiere á un tal niño en mi nombre, á mí recibe.
Y cualquiera que escandalizare á alguno de estos pequeños que creen en mí, mejor le fuera que se le colgase al cuello una piedra de molino de asno, y que se le anegase en el profundo de la mar.
¡Ay del mundo por los escándalos! porque necesario es que vengan escándalos; mas ¡ay de aquel hombre por el cual viene el escándalo!
Y si tu ojo te fuere ocasión de caer, sácalo y échalo de ti: mejor te es entrar con un solo ojo en la vida, que teniendo dos ojos ser echado en el infierno del fuego.
Mirad no tengáis en poco á alguno de estos pequeños; porque os digo que sus ángeles en los cielos ven siempre la faz de mi Padre que está en los cielos.
Porque el Hijo del hombre ha venido para salvar lo que se había perdido.
¿Qué os parece? Si tuviese algún hombre cien ovejas, y se descarriase una de ellas, ¿no iría por los montes, dejadas las noventa y nueve, á buscar la que se había descarriado?
Y si aconteciese hallarla, de cierto os digo, que más se goza de aquélla, que de las noventa y nueve que no se descarriaron.
Así, no es la voluntad de vuestro Padre que está en los cielos, que se pierda uno de estos pequeños.
Por tanto, si tu hermano pecare contra ti, ve, y redargúyele entre ti y él solo: si te oyere, has ganado á tu hermano.
Mas si no te oyere, toma aún contigo uno ó dos, para que en boca de dos ó de tres testigos conste toda palabra.
Y si no oyere á ellos, dilo á la iglesia: y si no oyere á la iglesia, tenle por étnico y publicano.
De cierto os digo que todo lo que ligareis en la tierra, será ligado en el cielo; y todo lo que desatareis en la tierra, será desatado en el cielo.
Otra vez os digo, que si dos de vosotros se convinieren en la tierra, de toda cosa que pidieren, les será hecho por mi Padre que está en los cielos.
Porque donde están dos ó tres congregados en mi nombre, allí estoy en medio de ellos.
Entonces Pedro, llegándose á él, dijo: Señor, ¿cuántas veces perdonaré á mi hermano que pecare contra mí? ¿hasta siete?
Jesús le dice: No te digo hasta siete, mas aun hasta setenta veces siete.
Por lo cual, el reino de los cielos es semejante á un hombre rey, que quiso hacer cuentas con sus siervos.
Y comenzando á hacer cuentas, le fué presentado uno que le debía diez mil talentos.
Mas á éste, no pudiendo pagar, mandó su señor venderle, y á su mujer é hijos, con todo lo que tenía, y que se le pagase.
Entonces aquel siervo, postrado, le adoraba, diciendo: Señor, ten paciencia conmigo, y yo te lo pagaré todo.
El señor, movido á misericordia de aquel siervo, le soltó y le perdonó la deuda.
Y saliendo aquel siervo, halló á uno de sus consiervos, que le debía cien denarios; y trabando de él, le ahogaba, diciendo: Págame lo que debes.
Entonces su consiervo, postrándose á sus pies, le rogaba, diciendo: Ten paciencia conmigo, y yo te lo pagaré todo.
Mas él no quiso; sino fué, y le echó en la cárcel hasta que pagase la deuda.
Y viendo sus consiervos lo que pasaba, se entristecieron mucho, y viniendo, declararon á su señor todo lo que había pasado.
Entonces llamándole su señor, le dice: Siervo malvado, toda aquella deuda te perdoné, porque me rogaste:
¿No te convenía también á ti tener misericordia de tu consiervo, como también yo tuve misericordia de ti?
Entonces su señor, enojado, le entregó á los verdugos, hasta que pagase todo lo que le debía.
Así también hará con vosotros mi Padre celestial, si no perdonareis de vuestros corazones cada uno á su hermano sus ofensas.
Y ACONTECIÓ que acabando Jesús estas palabras, se pasó de Galilea, y vino á los términos de Judea, pasado el Jordán.
Y le siguieron muchas gentes, y los sanó allí.
Entonces se llegaron á él los Fariseos, tentándole, y diciéndole: ¿Es lícito al hombre repudiar á su mujer por cualquiera causa?
Y él respondiendo, les dijo: ¿No habéis leído que el que los hizo al principio, macho y hembra los hizo,
Y dijo: Por tanto, el hombre dejará padre y madre, y se unirá á su mujer, y serán dos en una carne?
Así que, no son ya más dos, sino una carne: por tanto, lo que Dios juntó, no lo aparte el hombre.
Dícenle: ¿Por qué, pues, Moisés mandó dar carta de divorcio, y repudiarla?
Díceles: Por la dureza de vuestro corazón Moisés os permitió repudiar á vuestras mujeres: mas al principio no fué así.
Y yo os digo que cualquiera que repudiare á su mujer, si no fuere por causa de fornicación, y se casare con otra, adultera: y el que se casare con la repudiada, adultera.
Dícenle sus discípulos: Si así es la condición del hombre con su mujer, no conviene casarse.
Entonces él les dijo: No todos reciben esta palabra, sino aquellos á quienes es dado.
Entonces le fueron presentados unos niños, para que pusiese las manos sobre ellos, y orase; y los discípulos les riñeron.
Y Jesús dijo: Dejad á los niños, y no les impidáis de venir á mí; porque de los tales es el reino de los cielos.
Y habiendo puesto sobre ellos las manos, se partió de allí.
Y he aquí, uno llegándose le dijo: Maestro bueno, ¿qué bien haré para tener la vida eterna?
Y él le dijo: ¿Por qué me llamas bueno? Ninguno es bueno sino uno, es á saber, Dios: y si quieres entrar en la vida, guarda los mandamientos.
Dícele: ¿Cuáles? Y Jesús dijo: No matarás: No adulterarás: No hurtarás: No dirás falso testimonio:
Honra á tu padre y á tu madre: y, Amarás á tu prójimo como á ti mismo.
Dícele el mancebo: Todo esto guardé desde mi juventud: ¿qué más me falta?
Dícele Jesús: Si quieres ser perfecto, anda, vende lo que tienes, y dalo á los pobres, y tendrás tesoro en el cielo; y ven, sígueme.
Y oyendo el mancebo esta palabra, se fué triste, porque tenía muchas posesiones.
Entonces Jesús dijo á sus discípulos: De cierto os digo, que un rico difícilmente entrará en el reino de los cielos.
Mas os digo, que más liviano trabajo es pasar un camello por el ojo de una aguja, que entrar un rico en el reino de Dios.
Mas sus discípulos, oyendo estas cosas, se espantaron en gran manera, diciendo: ¿Quién pues podrá ser salvo?
Y mirándolos Jesús, les dijo: Para con los hombres imposible es esto; mas para con Dios todo es posible.
Entonces respondiendo Pedro, le dijo: He aquí, nosotros hemos dejado todo, y te hemos seguido: ¿qué pues tendremos?
Y cualquiera que dejare casas, ó hermanos, ó hermanas, ó padre, ó madre, ó mujer, ó hijos, ó tierras, por mi nombre, recibirá cien veces tanto, y heredará la vida eterna.
Mas muchos primeros serán postreros, y postreros primeros.
PORQUE el reino de los cielos es semejante á un hombre, padre de familia, que salió por la mañana á ajustar obreros para su viña.
Y habiéndose concertado con los obreros en un denario al día, los envió á su viña.
Y saliendo cerca de la hora de las tres, vió otros que estaban en la plaza ociosos;
Y les dijo: Id también vosotros á mi viña, y os daré lo que fuere justo. Y ellos fueron.
Salió otra vez cerca de las horas sexta y nona, é hizo lo mismo.
Y saliendo cerca de la hora undécima, halló otros que estaban ociosos; y díceles: ¿Por qué estáis aquí todo el día ociosos?
Dícenle: Porque nadie nos ha ajustado. Díceles: Id también vosotros á la viña, y recibiréis lo que fuere justo.
Y cuando fué la tarde del día, el señor de la viña dijo á su mayordomo: Llama á los obreros y págales el jornal, comenzando desde los postreros hasta los primeros.
Y viniendo los que habían ido cerca de la hora undécima, recibieron cada uno un denario.
Y viniendo también los primeros, pensaron que habían de recibir más; pero también ellos recibieron cada uno un denario.
Y tomándolo, murmuraban contra el padre de la familia,
Diciendo: Estos postreros sólo han trabajado una hora, y los has hecho iguales á nosotros, que hemos llevado la carga y el calor del día.
Y él respondiendo, dijo á uno de ellos: Amigo, no te hago agravio; ¿no te concertaste conmigo por un denario?
Toma lo que es tuyo, y vete; mas quiero dar á este postrero, como á ti.
¿No me es lícito á mí hacer lo que quiero con lo mío? ó ¿es malo tu ojo, porque yo soy bueno?
Así los primeros serán postreros, y los postreros primeros: porque muchos son llamados, mas pocos escogidos.
Y subiendo Jesús á Jerusalem, tomó sus doce discípulos aparte en el camino, y les dijo:
He aquí subimos á Jerusalem, y el Hijo del hombre será entregado á los príncipes de los sacerdotes y á los escribas, y le condenarán á muerte;
Y le entregarán á los Gentiles para que le escarnezcan, y azoten, y crucifiquen; mas al tercer día resucitará.
Entonces se llegó á él la madre de los hijos de Zebedeo con sus hijos, adorándole, y pidiéndole algo.
Y él le dijo: ¿Qué quieres? Ella le dijo: Di que se sienten estos dos hijos míos, el uno á tu mano derecha, y el otro á tu izquierda, en tu reino.
Y como los diez oyeron esto, se enojaron de los dos hermanos.
Entonces Jesús llamándolos, dijo: Sabéis que los príncipes de los Gentiles se enseñorean sobre ellos, y los que son grandes ejercen sobre ellos potestad.
Mas entre vosotros no será así; sino el que quisiere entre vosotros hacerse grande, será vuestro servidor;
Y el que quisiere entre vosotros ser el primero, será vuestro siervo:
Como el Hijo del hombre no vino para ser servido, sino para servir, y para dar su vida en rescate por muchos.
Entonces saliendo ellos de Jericó, le seguía gran compañía.
Y he aquí dos ciegos sentados junto al camino, como oyeron que Jesús pasaba, clamaron, diciendo: Señor, Hijo de David, ten misericordia de nosotros.
Y la gente les reñía para que callasen; mas ellos clamaban más, diciendo: Señor, Hijo de David, ten misericordia de nosotros.
Y parándose Jesús, los llamó, y dijo: ¿Qué queréis que haga por vosotros?
Ellos le dicen: Señor, que sean abiertos nuestros ojos.
Entonces Jesús, teniendo misericordia de ellos, les tocó los ojos, y luego sus ojos recibieron la vista; y le siguieron.
Y COMO se acercaron á Jerusalem, y vinieron á Bethfagé, al monte de las Olivas, entonces Jesús envió dos discípulos,
Diciéndoles: Id á la aldea que está delante de vosotros, y luego hallaréis una asna atada, y un pollino con ella: desatadla, y traédmelos.
Y si alguno os dijere algo, decid: El Señor los ha menester. Y luego los dejará.
Y todo esto fué hecho, para que se cumpliese lo que fué dicho por el profeta, que dijo:
Decid á la hija de Sión: He aquí, tu Rey viene á ti, manso, y sentado sobre una asna, y sobre un pollino, hijo de animal de yugo.
Y los discípulos fueron, é hicieron como Jesús les mandó;
Y trajeron el asna y el pollino, y pusieron sobre ellos sus mantos; y se sentó sobre ellos.
Y la compañía, que eramuy numerosa, tendía sus mantos en el camino: y otros cortaban ramos de los árboles, y los tendían por el camino.
Y las gentes que iban delante, y las que iban detrás, aclamaban diciendo: ¡Hosanna al Hijo de David! ¡Bendito el que viene en el nombre del Señor! ¡Hosanna en las alturas!
Y entrando él en Jerusalem, toda la ciudad se alborotó, diciendo: ¿Quién es éste?
Y las gentes decían: Este es Jesús, el profeta, de Nazaret de Galilea.
Y entró Jesús en el templo de Dios, y echó fuera todos los que vendían y compraban en el templo, y trastornó las mesas de los cambiadores, y las sillas de los que vendían palomas;
Y les dice: Escrito está: Mi casa, casa de oración será llamada; mas vosotros cueva de ladrones la habéis hecho.
Entonces vinieron á él ciegos y cojos en el templo, y los sanó.
Mas los príncipes de los sacerdotes y los escribas, viendo las maravillas que hacía, y á los muchachos aclamando en el templo y diciendo: ¡Hosanna al Hijo de David! se indignaron,
Y le dijeron: ¿Oyes lo que éstos dicen? Y Jesús les dice: Sí: ¿nunca leísteis: De la boca de los niños y de los que maman perfeccionaste la alabanza?
Y dejándolos, se salió fuera de la ciudad, á Bethania; y posó allí.
Y por la mañana volviendo á la ciudad, tuvo hambre.
Y viendo una higuera cerca del camino, vino á ella, y no halló nada en ella, sino hojas solamente; y le dijo: Nunca más para siempre nazca de ti fruto. Y luego se secó la higuera.
Y viendo esto los discípulos, maravillados decían: ¿Cómo se secó luego la higuera?
Y todo lo que pidiereis en oración, creyendo, lo recibiréis.
Y como vino al templo, llegáronse á él cuando estaba enseñando, los príncipes de los sacerdotes y los ancianos del pueblo, diciendo: ¿Con qué autoridad haces esto? ¿y quién te dió esta autoridad?
Y respondiendo Jesús, les dijo: Yo también os preguntaré una palabra, la cual si me dijereis, también yo os diré con qué autoridad hago esto.
El bautismo de Juan, ¿de dónde era? ¿del cielo, ó de los hombres? Ellos entonces pensaron entre sí, diciendo: Si dijéremos, del cielo, nos dirá: ¿Por qué pues no le creísteis?
Y si dijéremos, de los hombres, tememos al pueblo; porque todos tienen á Juan por profeta.
Y respondiendo á Jesús, dijeron: No sabemos. Y él también les dijo: Ni yo os digo con qué autoridad hago esto.
Mas, ¿qué os parece? Un hombre tenía dos hijos, y llegando al primero, le dijo: Hijo, ve hoy á trabajar en mi viña.
Y respondiendo él, dijo: No quiero; mas después, arrepentido, fué.
Y llegando al otro, le dijo de la misma manera; y respondiendo él, dijo: Yo, señor, voy. Y no fué.
Y cuando se acercó el tiempo de los frutos, envió sus siervos á los labradores, para que recibiesen sus frutos.
Mas los labradores, tomando á los siervos, al uno hirieron, y al otro mataron, y al otro apedrearon.
Envió de nuevo otros siervos, más que los primeros; é hicieron con ellos de la misma manera.
Y á la postre les envió su hijo, diciendo: Tendrán respeto á mi hijo.
Mas los labradores, viendo al hijo, dijeron entre sí: Este es el heredero; venid, matémosle, y tomemos su heredad.
Y tomado, le echaron fuera de la viña, y le mataron.
Pues cuando viniere el señor de la viña, ¿qué hará á aquellos labradores?
Dícenle: á los malos destruirá miserablemente, y su viña dará á renta á otros labradores, que le paguen el fruto á sus tiempos.
Díceles Jesús: ¿Nunca leísteis en las Escrituras: La piedra que desecharon los que edificaban, ésta fué hecha por cabeza de esquina: por el Señor es hecho esto, y es cosa maravillosa en nuestros ojos?
Por tanto os digo, que el reino de Dios será quitado de vosotros, y será dado á gente que haga los frutos de él.
Y el que cayere sobre esta piedra, será quebrantado; y sobre quien ella cayere, le desmenuzará.
Y oyendo los príncipes de los sacerdotes y los Fariseos sus parábolas, entendieron que hablaba de ellos.
Y buscando cómo echarle mano, temieron al pueblo; porque le tenían por profeta.
Y RESPONDIENDO Jesús, les volvió á hablar en parábolas, diciendo:
El reino de los cielos es semejante á un hombre rey, que hizo bodas á su hijo;
Y envió sus siervos para que llamasen los llamados á las bodas; mas no quisieron venir.
Volvió á enviar otros siervos, diciendo: Decid á los llamados: He aquí, mi comida he aparejado; mis toros y animales engordados son muertos, y todo está prevenido: venid á las bodas.
Mas ellos no se cuidaron, y se fueron, uno á su labranza, y otro á sus negocios;
Y otros, tomando á sus siervos, los afrentaron y los mataron.
Y el rey, oyendoesto, se enojó; y enviando sus ejércitos, destruyó á aquellos homicidas, y puso fuego á su ciudad.
Entonces dice á sus siervos: Las bodas á la verdad están aparejadas; mas los que eran llamados no eran dignos.
Id pues á las salidas de los caminos, y llamad á las bodas á cuantos hallareis.
Y saliendo los siervos por los caminos, juntaron á todos los que hallaron, juntamente malos y buenos: y las bodas fueron llenas de convidados.
Y entró el rey para ver los convidados, y vió allí un hombre no vestido de boda.
Y le dijo: Amigo, ¿cómo entraste aquí no teniendo vestido de boda? Mas él cerró la boca.
Entonces el rey dijo á los que servían: Atado de pies y de manos tomadle, y echadle en las tinieblas de afuera: allí será el lloro y el crujir de dientes.
Porque muchos son llamados, y pocos escogidos.
Entonces, idos los Fariseos, consultaron cómo le tomarían en alguna palabra.
Dinos pues, ¿qué te parece? ¿es lícito dar tributo á César, ó no?
Mas Jesús, entendida la malicia de ellos, les dice: ¿Por qué me tentáis, hipócritas?
Mostradme la moneda del tributo. Y ellos le presentaron un denario.
Entonces les dice: ¿Cúya es esta figura, y lo que está encima escrito?
Dícenle: De César. Y díceles: Pagad pues á César lo que es de César, y á Dios lo que es de Dios.
Y oyendo esto, se maravillaron; y dejándole se fueron.
Aquel día llegaron á él los Saduceos, que dicen no haber resurrección, y le preguntaron,
Diciendo: Maestro, Moisés dijo: Si alguno muriere sin hijos, su hermano se casará con su mujer, y despertará simiente á su hermano.
Fueron pues, entre nosotros siete hermanos: y el primero tomó mujer, y murió; y no teniendo generación, dejó su mujer á su hermano.
De la misma manera también el segundo, y el tercero, hasta los siete.
Y después de todos murió también la mujer.
En la resurrección pues, ¿de cuál de los siete será ella mujer? porque todos la tuvieron.
Entonces respondiendo Jesús, les dijo: Erráis ignorando las Escrituras, y el poder de Dios.
Porque en la resurrección, ni los hombres tomarán mujeres, ni las mujeres maridos; mas son como los ángeles de Dios en el cielo.
Y de la resurrección de los muertos, ¿no habéis leído lo que os es dicho por Dios, que dice:
Yo soy el Dios de Abraham, y el Dios de Isaac, y el Dios de Jacob? Dios no es Dios de muertos, sino de vivos.
Y oyendo esto las gentes, estaban atónitas de su doctrina.
Entonces los Fariseos, oyendo que había cerrado la boca á los Saduceos, se juntaron á una.
Y preguntó uno de ellos, intérprete de la ley, tentándole y diciendo:
Maestro, ¿cuál es el mandamiento grande en la ley?
Y Jesús le dijo: Amarás al Señor tu Dios de todo tu corazón, y de toda tu alma, y de toda tu mente.
Este es el primero y el grande mandamiento.
Y el segundo es semejante á éste: Amarás á tu prójimo como á ti mismo.
De estos dos mandamientos depende toda la ley y los profetas.
Y estando juntos los Fariseos, Jesús les preguntó,
Diciendo: ¿Qué os parece del Cristo? ¿de quién es Hijo? Dícenle: De David.
El les dice: ¿Pues cómo David en Espíritu le llama Señor, diciendo:
Dijo el Señor á mi Señor: Siéntate á mi diestra, entre tanto que pongo tus enemigos por estrado de tus pies?
Pues si David le llama Señor, ¿cómo es su Hijo?
Y nadie le podía responder palabra; ni osó alguno desde aquel día preguntarle más.
ENTONCES habló Jesús á las gentes y á sus discípulos,
Diciendo: Sobre la cátedra de Moisés se sentaron los escribas y los Fariseos:
Así que, todo lo que os dijeren que guardéis, guardadloy hacedlo; mas no hagáis conforme á sus obras: porque dicen, y no hacen.
Porque atan cargas pesadas y difíciles de llevar, y las ponen sobre los hombros de los hombres; mas ni aun con su dedo las quieren mover.
Antes, todas sus obras hacen para ser mirados de los hombres; porque ensanchan sus filacterias, y extienden los flecos de sus mantos;
Y aman los primeros asientos en las cenas, y las primeras sillas en las sinagogas;
Y las salutaciones en las plazas, y ser llamados de los hombres Rabbí, Rabbí.
Mas vosotros, no queráis ser llamados Rabbí; porque uno es vuestro Maestro, el Cristo; y todos vosotros sois hermanos.
Y vuestro padre no llaméis á nadie en la tierra; porque uno es vuestro Padre, el cual está en los cielos.
Ni seáis llamados maestros; porque uno es vuestro Maestro, el Cristo.
El que es el mayor de vosotros, sea vuestro siervo.
Porque el que se ensalzare, será humillado; y el que se humillare, será ensalzado.
Mas ¡ay de vosotros, escribas y Fariseos, hipócritas! porque cerráis el reino de los cielos delante de los hombres; que ni vosotros entráis, ni á los que están entrando dejáis entrar.
¡Ay de vosotros, escribas y Fariseos, hipócritas! porque coméis las casas de las viudas, y por pretexto hacéis larga oración: por esto llevaréis más grave juicio.
¡Ay de vosotros, escribas y Fariseos, hipócritas! porque rodeáis la mar y la tierra por hacer un prosélito; y cuando fuere hecho, le hacéis hijo del infierno doble más que vosotros.
¡Ay de vosotros, guías ciegos! que decís: Cualquiera que jurare por el templo es nada; mas cualquiera que jurare por el oro del templo, deudor es.
¡Insensatos y ciegos! porque ¿cuál es mayor, el oro, ó el templo que santifica al oro?
Y: Cualquiera que jurare por el altar, es nada; mas cualquiera que jurare por el presente que está sobre él, deudor es.
¡Necios y ciegos! porque, ¿cuál es mayor, el presente, ó el altar que santifica al presente?
Pues el que jurare por el altar, jura por él, y por todo lo que está sobre él;
Y el que jurare por el templo, jura por él, y por Aquél que habita en él;
Y el que jura por el cielo, jura por el trono de Dios, y por Aquél que está sentado sobre él.
¡Guías ciegos, que coláis el mosquito, mas tragáis el camello!
¡Ay de vosotros, escribas y Fariseos, hipócritas! porque limpiáis lo que está de fuera del vaso y del plato; mas de dentro están llenos de robo y de injusticia.
¡Fariseo ciego, limpia primero lo de dentro del vaso y del plato, para que también lo de fuera se haga limpio!
Así también vosotros de fuera, á la verdad, os mostráis justos á los hombres; mas de dentro, llenos estáis de hipocresía é iniquidad.
¡Ay de vosotros, escribas y Fariseos, hipócritas! porque edificáis los sepulcros de los profetas, y adornáis los monumentos de los justos,
Y decís: Si fuéramos en los días de nuestros padres, no hubiéramos sido sus compañeros en la sangre de los profetas.
Así que, testimonio dais á vosotros mismos, que sois hijos de aquellos que mataron á los profetas.
¡Vosotros también henchid la medida de vuestros padres!
¡Serpientes, generación de víboras! ¿cómo evitaréis el juicio del infierno?
De cierto os digo que todo esto vendrá sobre esta generación.
He aquí vuestra casa os es dejada desierta.
Porque os digo que desde ahora no me veréis, hasta que digáis: Bendito el que viene en el nombre del Señor.
Y SALIDO Jesús, íbase del templo; y se llegaron sus discípulos, para mostrarle los edificios del templo.
Y respondiendo él, les dijo: ¿Veis todo esto? de cierto os digo, que no será dejada aquí piedra sobre piedra, que no sea destruída.
Y sentándose él en el monte de las Olivas, se llegaron á él los discípulos aparte, diciendo: Dinos, ¿cuándo serán estas cosas, y qué señal habrá de tu venida, y del fin del mundo?
Y respondiendo Jesús, les dijo: Mirad que nadie os engañe.
Porque vendrán muchos en mi nombre, diciendo: Yo soy el Cristo; y á muchos engañarán.
Y oiréis guerras, y rumores de guerras: mirad que no os turbéis; porque es menester que todo esto acontezca; mas aún no es el fin.
Porque se levantará nación contra nación, y reino contra reino; y habrá pestilencias, y hambres, y terremotos por los lugares.
Y todas estas cosas, principio de dolores.
Entonces os entregarán para ser afligidos, y os matarán; y seréis aborrecidos de todas las gentes por causa de mi nombre.
Y muchos entonces serán escandalizados; y se entregarán unos á otros, y unos á otros se aborrecerán.
Y muchos falsos profetas se levantarán y engañarán á muchos.
Y por haberse multiplicado la maldad, la caridad de muchos se resfriará.
Mas el que perseverare hasta el fin, éste será salvo.
Y será predicado este evangelio del reino en todo el mundo, por testimonio á todos los Gentiles; y entonces vendrá el fin.
Por tanto, cuando viereis la abominación del asolamiento, que fué dicha por Daniel profeta, que estará en el lugar santo, (el que lee, entienda),
Entonces los que están en Judea, huyan á los montes;
Y el que sobre el terrado, no descienda á tomar algo de su casa;
Y el que en el campo, no vuelva atrás á tomar sus vestidos.
Mas ¡ay de las preñadas, y de las que crían en aquellos días!
Orad, pues, que vuestra huída no sea en invierno ni en sábado;
Porque habrá entonces grande aflicción, cual no fué desde el principio del mundo hasta ahora, ni será.
Y si aquellos días no fuesen acortados, ninguna carne sería salva; mas por causa de los escogidos, aquellos días serán acortados.
Entonces, si alguno os dijere: He aquí está el Cristo, ó allí, no creáis.
Porque se levantarán falsos Cristos, y falsos profetas, y darán señales grandes y prodigios; de tal manera que engañarán, si es posible, aun á los escogidos.
He aquí os lo he dicho antes.
Así que, si os dijeren: He aquí en el desierto está; no salgáis: He aquí en las cámaras; no creáis.
Porque como el relámpago que sale del oriente y se muestra hasta el occidente, así será también la venida del Hijo del hombre.
Porque donde quiera que estuviere el cuerpo muerto, allí se juntarán las águilas.
Y luego después de la aflicción de aquellos días, el sol se obscurecerá, y la luna no dará su lumbre, y las estrellas caerán del cielo, y las virtudes de los cielos serán conmovidas.
Y enviará sus ángeles con gran voz de trompeta, y juntarán sus escogidos de los cuatro vientos, de un cabo del cielo hasta el otro.
De la higuera aprended la parábola: Cuando ya su rama se enternece, y las hojas brotan, sabéis que el verano está cerca.
Así también vosotros, cuando viereis todas estas cosas, sabed que está cercano, á las puertas.
De cierto os digo, que no pasará esta generación, que todas estas cosas no acontezcan.
El cielo y la tierra pasarán, mas mis palabras no pasarán.
Empero del día y hora nadie sabe, ni aun los ángeles de los cielos, sino mi Padre solo.
Mas como los días de Noé, así será la venida del Hijo del hombre.
Porque como en los días antes del diluvio estaban comiendo y bebiendo, casándose y dando en casamiento, hasta el día que Noé entró en el arca,
Y no conocieron hasta que vino el diluvio y llevó á todos, así será también la venida del Hijo del hombre.
Entonces estarán dos en el campo; el uno será tomado, y el otro será dejado:
Dos mujeres moliendo á un molinillo; la una será tomada, y la otra será dejada.
Velad pues, porque no sabéis á qué hora ha de venir vuestro Señor.
Esto empero sabed, que si el padre de la familia supiese á cuál vela el ladrón había de venir, velaría, y no dejaría minar su casa.
Por tanto, también vosotros estad apercibidos; porque el Hijo del hombre ha de venir á la hora que no pensáis.
¿Quién pues es el siervo fiel y prudente, al cual puso su señor sobre su familia para que les dé alimento á tiempo?
Bienaventurado aquel siervo, al cual, cuando su señor viniere, le hallare haciendo así.
De cierto os digo, que sobre todos sus bienes le pondrá.
Y si aquel siervo malo dijere en su corazón: Mi señor se tarda en venir:
Y comenzare á herir á sus consiervos, y aun á comer y á beber con los borrachos;
Vendrá el señor de aquel siervo en el día que no espera, y á la hora que no sabe,
Y le cortará por medio, y pondrá su parte con los hipócritas: allí será el lloro y el crujir de dientes.
ENTONCES el reino de los cielos será semejante á diez vírgenes, que tomando sus lámparas, salieron á recibir al esposo.
Y las cinco de ellas eran prudentes, y las cinco fatuas.
Las que eran fatuas, tomando sus lámparas, no tomaron consigo aceite;
Mas las prudentes tomaron aceite en sus vasos, juntamentecon sus lámparas.
Y tardándose el esposo, cabecearon todas, y se durmieron.
Y á la media noche fué oído un clamor: He aquí, el esposo viene; salid á recibirle.
Entonces todas aquellas vírgenes se levantaron, y aderezaron sus lámparas.
Y las fatuas dijeron á las prudentes: Dadnos de vuestro aceite; porque nuestras lámparas se apagan.
Mas las prudentes respondieron, diciendo: Porque no nos falte á nosotras y á vosotras, id antes á los que venden, y comprad para vosotras.
Y mientras que ellas iban á comprar, vino el esposo; y las que estaban apercibidas, entraron con él á las bodas; y se cerró la puerta.
Y después vinieron también las otras vírgenes, diciendo: Señor, Señor, ábrenos.
Mas respondiendo él, dijo: De cierto os digo, queno os conozco.
Velad, pues, porque no sabéis el día ni la hora en que el Hijo del hombre ha de venir.
Porque el reino de los cielos es como un hombre que partiéndose lejos llamó á sus siervos, y les entregó sus bienes.
Y á éste dió cinco talentos, y al otro dos, y al otro uno: á cada uno conforme á su facultad; y luego se partió lejos.
Y el que había recibido cinco talentos se fué, y granjeó con ellos, é hizo otros cinco talentos.
Asimismo el que había recibido dos, ganó también él otros dos.
Mas el que había recibido uno, fué y cavó en la tierra, y escondió el dinero de su señor.
Y después de mucho tiempo, vino el señor de aquellos siervos, é hizo cuentas con ellos.
Y llegando el que había recibido cinco talentos, trajo otros cinco talentos, diciendo: Señor, cinco talentos me entregaste; he aquí otros cinco talentos he ganado sobre ellos.
Y su señor le dijo: Bien, buen siervo y fiel; sobre poco has sido fiel, sobre mucho te pondré: entra en el gozo de tu señor.
Y llegando también el que había recibido dos talentos, dijo: Señor, dos talentos me entregaste; he aquí otros dos talentos he ganado sobre ellos.
Su señor le dijo: Bien, buen siervo y fiel; sobre poco has sido fiel, sobre mucho te pondré: entra en el gozo de tu señor.
Y llegando también el que había recibido un talento, dijo: Señor, te conocía que eres hombre duro, que siegas donde no sembraste, y recoges donde no esparciste;
Y tuve miedo, y fuí, y escondí tu talento en la tierra: he aquí tienes lo que es tuyo.
Y respondiendo su señor, le dijo: Malo y negligente siervo, sabías que siego donde no sembré y que recojo donde no esparcí;
Por tanto te convenía dar mi dinero á los banqueros, y viniendo yo, hubiera recibido lo que es mío con usura.
Quitadle pues el talento, y dadlo al que tiene diez talentos.
Porque á cualquiera que tuviere, le será dado, y tendrá más; y al que no tuviere, aun lo que tiene le será quitado.
Y al siervo inútil echadle en las tinieblas de afuera: allí será el lloro y el crujir de dientes.
Y cuando el Hijo del hombre venga en su gloria, y todos los santos ángeles con él, entonces se sentará sobre el trono de su gloria.
Y serán reunidas delante de él todas las gentes: y los apartará los unos de los otros, como aparta el pastor las ovejas de los cabritos.
Y pondrá las ovejas á su derecha, y los cabritos á la izquierda.
Entonces el Rey dirá á los que estarán á su derecha: Venid, benditos de mi Padre, heredad el reino preparado para vosotros desde la fundación del mundo:
Porque tuve hambre, y me disteis de comer; tuve sed, y me disteis de beber; fuí huésped, y me recogisteis;
Desnudo, y me cubristeis; enfermo, y me visitasteis; estuve en la cárcel, y vinisteis á mí.
Entonces los justos le responderán, diciendo: Señor, ¿cuándo te vimos hambriento, y te sustentamos? ¿ó sediento, y te dimos de beber?
¿Y cuándo te vimos huésped, y te recogimos? ¿ó desnudo, y te cubrimos?
¿O cuándo te vimos enfermo, ó en la cárcel, y vinimos á ti?
Y respondiendo el Rey, les dirá: De cierto os digo que en cuanto lo hicisteis á uno de estos mis hermanos pequeñitos, á mí lo hicisteis.
Entonces dirá también á los que estarán á la izquierda: Apartaos de mí, malditos, al fuego eterno preparado para el diablo y para sus ángeles:
Porque tuve hambre, y no me disteis de comer; tuve sed, y no me disteis de beber;
Fuí huésped, y no me recogisteis; desnudo, y no me cubristeis; enfermo, y en la cárcel, y no me visitasteis.
Entonces también ellos le responderán, diciendo: Señor, ¿cuándo te vimos hambriento, ó sediento, ó huésped, ó desnudo, ó enfermo, ó en la cárcel, y no te servimos?
Entonces les responderá, diciendo: De cierto os digo que en cuanto no lo hicisteis á uno de estos pequeñitos, ni á mí lo hicisteis.
E irán éstos al tormento eterno, y los justos á la vida eterna.
Y ACONTECIÓ que, como hubo acabado Jesús todas estas palabras, dijo á sus discípulos:
Sabéis que dentro de dos días se hace la pascua, y el Hijo del hombre es entregado para ser crucificado.
Entonces los príncipes de los sacerdotes, y los escribas, y los ancianos del pueblo se juntaron al patio del pontífice, el cual se llamaba Caifás;
Y tuvieron consejo para prender por engaño á Jesús, y matarle.
Y decían: No en el día de la fiesta, porque no se haga alboroto en el pueblo.
Y estando Jesús en Bethania, en casa de Simón el leproso,
Vino á él una mujer, teniendo un vaso de alabastro de ungüento de gran precio, y lo derramó sobre la cabeza de él, estando sentado á la mesa.
Lo cual viendo sus discípulos, se enojaron, diciendo: ¿Por qué se pierde esto?
Porque esto se podía vender por gran precio, y darse á los pobres.
Y entendiéndolo Jesús, les dijo: ¿Por qué dais pena á esta mujer? pues ha hecho conmigo buena obra.
Porque siempre tendréis pobres con vosotros, mas á mí no siempre me tendréis.
Porque echando este ungüento sobre mi cuerpo, para sepultarme lo ha hecho.
De cierto os digo, que donde quiera que este evangelio fuere predicado en todo el mundo, también será dicho para memoria de ella, lo que ésta ha hecho.
Entonces uno de los doce, que se llamaba Judas Iscariote, fué á los príncipes de los sacerdotes,
Y les dijo: ¿Qué me queréis dar, y yo os lo entregaré? Y ellos le señalaron treinta piezas de plata.
Y desde entonces buscaba oportunidad para entregarle.
Y el primer día de la fiesta de los panes sin levadura, vinieron los discípulos á Jesús, diciéndole: ¿Dónde quieres que aderecemos para ti para comer la pascua?
Y él dijo: Id á la ciudad á cierto hombre, y decidle: El Maestro dice: Mi tiempo está cerca; en tu casa haré la pascua con mis discípulos.
Y los discípulos hicieron como Jesús les mandó, y aderezaron la pascua.
Y como fué la tarde del día, se sentó á la mesa con los doce.
Y comiendo ellos, dijo: De cierto os digo, que uno de vosotros me ha de entregar.
Y entristecidos ellos en gran manera, comenzó cada uno de ellos á decirle: ¿Soy yo, Señor?
Entonces él respondiendo, dijo: El que mete la mano conmigo en el plato, ése me ha de entregar.
A la verdad el Hijo del hombre va, como está escrito de él; mas ¡ay de aquel hombre por quien el Hijo del hombre es entregado! bueno le fuera al tal hombre no haber nacido.
Entonces respondiendo Judas, que le entregaba, dijo: ¿Soy yo, Maestro? Dícele: Tú lo has dicho.
Y comiendo ellos, tomó Jesús el pan, y bendijo, y lo partió, y dió á sus discípulos, y dijo: Tomad, comed: esto es mi cuerpo.
Y tomando el vaso, y hechas gracias, les dió, diciendo: Bebed de él todos;
Porque esto es mi sangre del nuevo pacto, la cual es derramada por muchos para remisión de los pecados.
Y os digo, que desde ahora no beberé más de este fruto de la vid, hasta aquel día, cuando lo tengo de beber nuevo con vosotros en el reino de mi Padre.
Y habiendo cantado el himno, salieron al monte de las Olivas.
Entonces Jesús les dice: Todos vosotros seréis escandalizados en mí esta noche; porque escrito está: Heriré al Pastor, y las ovejas de la manada serán dispersas.
Mas después que haya resucitado, iré delante de vosotros á Galilea.
Y respondiendo Pedro, le dijo: Aunque todos sean escandalizados en ti, yo nunca seré escandalizado.
Jesús le dice: De cierto te digo que esta noche, antes que el gallo cante, me negarás tres veces.
Dícele Pedro: Aunque me sea menester morir contigo, no te negaré. Y todos los discípulos dijeron lo mismo.
Entonces llegó Jesús con ellos á la aldea que se llama Gethsemaní, y dice á sus discípulos: Sentaos aquí, hasta que vaya allí y ore.
Y tomando á Pedro, y á los dos hijos de Zebedeo, comenzó á entristecerse y á angustiarse en gran manera.
Entonces Jesús les dice: Mi alma está muy triste hasta la muerte; quedaos aquí, y velad conmigo.
Y yéndose un poco más adelante, se postró sobre su rostro, orando, y diciendo: Padre mío, si es posible, pase de mí este vaso; empero no como yo quiero, sino como tú.
Y vino á sus discípulos, y los halló durmiendo, y dijo á Pedro: ¿Así no habéis podido velar conmigo una hora?
Velad y orad, para que no entréis en tentación: el espíritu á la verdad está presto, mas la carne enferma.
Otra vez fué, segunda vez, y oró diciendo: Padre mío, si no puede este vaso pasar de mí sin que yo lo beba, hágase tu voluntad.
Y vino, y los halló otra vez durmiendo; porque los ojos de ellos estaban agravados.
Y dejándolos fuése de nuevo, y oró tercera vez, diciendo las mismas palabras.
Entonces vino á sus discípulos y díceles: Dormid ya, y descansad: he aquí ha llegado la hora, y el Hijo del hombre es entregado en manos de pecadores.
Levantaos, vamos: he aquí ha llegado el que me ha entregado.
Y hablando aún él, he aquí Judas, uno de los doce, vino, y con él mucha gente con espadas y con palos, de parte de los príncipes de los sacerdotes, y de los ancianos del pueblo.
Y el que le entregaba les había dado señal, diciendo: Al que yo besare, aquél es: prendedle.
Y luego que llegó á Jesús, dijo: Salve, Maestro. Y le besó.
Y Jesús le dijo: Amigo, ¿á qué vienes? Entonces llegaron, y echaron mano á Jesús, y le prendieron.
Y he aquí, uno de los que estaban con Jesús, extendiendo la mano, sacó su espada, é hiriendo á un siervo del pontífice, le quitó la oreja.
Entonces Jesús le dice: Vuelve tu espada á su lugar; porque todos los que tomaren espada, á espada perecerán.
¿Acaso piensas que no puedo ahora orar á mi Padre, y él me daría más de doce legiones de ángeles?
¿Cómo, pues, se cumplirían las Escrituras, que así conviene que sea hecho?
En aquella hora dijo Jesús á las gentes: ¿Como á ladrón habéis salido con espadas y con palos á prenderme? Cada día me sentaba con vosotros enseñando en el templo, y no me prendisteis.
Mas todo esto se hace, para que se cumplan las Escrituras de los profetas. Entonces todos los discípulos huyeron, dejándole.
Y ellos, prendido Jesús, le llevaron á Caifás pontífice, donde los escribas y los ancianos estaban juntos.
Mas Pedro le seguía de lejos hasta el patio del pontífice; y entrando dentro, estábase sentado con los criados, para ver el fin.
Y los príncipes de los sacerdotes, y los ancianos, y todo el consejo, buscaban falso testimonio contra Jesús, para entregarle á la muerte;
Y no lo hallaron, aunque muchos testigos falsos se llegaban; mas á la postre vinieron dos testigos falsos,
Que dijeron: Este dijo: Puedo derribar el templo de Dios, y en tres días reedificarlo.
Y levantándose el pontífice, le dijo: ¿No respondes nada? ¿qué testifican éstos contra ti?
Mas Jesús callaba. Respondiendo el pontífice, le dijo: Te conjuro por el Dios viviente, que nos digas si eres tú el Cristo, Hijo de Dios.
Jesús le dijo: Tú lo has dicho: y aun os digo, que desde ahora habéis de ver al Hijo del hombre sentado á la diestra de la potencia de Dios, y que viene en las nubes del cielo.
Entonces el pontífice rasgó sus vestidos, diciendo: Blasfemado ha: ¿qué más necesidad tenemos de testigos? He aquí, ahora habéis oído su blasfemia.
¿Qué os parece? Y respondiendo ellos, dijeron: Culpado es de muerte.
Entonces le escupieron en el rostro, y le dieron de bofetadas; y otros le herían con mojicones,
Diciendo: Profetízanos tú, Cristo, quién es el que te ha herido.
Y Pedro estaba sentado fuera en el patio: y se llegó á él una criada, diciendo: Y tú con Jesús el Galileo estabas.
Mas él negó delante de todos, diciendo: No sé lo que dices.
Y saliendo él á la puerta, le vió otra, y dijo á los que estaban allí: También éste estaba con Jesús Nazareno.
Y negó otra vez con juramento: No conozco al hombre.
Y un poco después llegaron los que estaban por allí, y dijeron á Pedro: Verdaderamente también tú eres de ellos, porque aun tu habla te hace manifiesto.
Entonces comenzó á hacer imprecaciones, y á jurar, diciendo: No conozco al hombre. Y el gallo cantó luego.
Y se acordó Pedro de las palabras de Jesús, que le dijo: Antes que cante el gallo, me negarás tres veces. Y saliéndose fuera, lloró amargamente.
Y VENIDA la mañana, entraron en consejo todos los príncipes de los sacerdotes, y los ancianos del pueblo, contra Jesús, para entregarle á muerte.
Y le llevaron atado, y le entregaron á Poncio Pilato presidente.
Entonces Judas, el que le había entregado, viendo que era condenado, volvió arrepentido las treintapiezasde plata á los príncipes de los sacerdotes y á los ancianos,
Diciendo: Yo he pecado entregando la sangre inocente. Mas ellos dijeron: ¿Qué se nos da á nosotros? Viéraslo tú.
Y arrojando las piezas de plata en el templo, partióse; y fué, y se ahorcó.
Y los príncipes de los sacerdotes, tomando las piezas de plata, dijeron: No es lícito echarlas en el tesoro de los dones, porque es precio de sangre.
Mas habido consejo, compraron con ellas el campo del alfarero, por sepultura para los extranjeros.
Por lo cual fué llamado aquel campo, Campo de sangre, hasta el día de hoy.
Y las dieron para el campo del alfarero, como me ordenó el Señor.
Y Jesús estuvo delante del presidente; y el presidente le preguntó, diciendo: ¿Eres tú el Rey de los judíos? Y Jesús le dijo: Tú lo dices.
Y siendo acusado por los príncipes de los sacerdotes, y por los ancianos, nada respondió.
Pilato entonces le dice: ¿No oyes cuántas cosas testifican contra ti?
Y no le respondió ni una palabra; de tal manera que el presidente se maravillaba mucho.
Y en el día de la fiesta acostumbraba el presidente soltar al pueblo un preso, cual quisiesen.
Y tenían entonces un preso famoso que se llamaba Barrabás.
Y juntos ellos, les dijo Pilato: ¿Cuál queréis que os suelte? ¿á Barrabás, ó á Jesús que se dice el Cristo?
Porque sabía que por envidia le habían entregado.
Y estando él sentado en el tribunal, su mujer envió á él, diciendo: No tengas que ver con aquel justo; porque hoy he padecido muchas cosas en sueños por causa de él.
Mas los príncipes de los sacerdotes y los ancianos, persuadieron al pueblo que pidiese á Barrabás, y á Jesús matase.
Y respondiendo el presidente les dijo: ¿Cuál de los dos queréis que os suelte? Y ellos dijeron: A Barrabás.
Pilato les dijo: ¿Qué pues haré de Jesús que se dice el Cristo? Dícenle todos: Sea crucificado.
Y el presidente les dijo: Pues ¿qué mal ha hecho? Mas ellos gritaban más, diciendo: Sea crucificado.
Y respondiendo todo el pueblo, dijo: Su sangre sea sobre nosotros, y sobre nuestros hijos.
Entonces les soltó á Barrabás: y habiendo azotado á Jesús, le entregó para ser crucificado.
Entonces los soldados del presidente llevaron á Jesús al pretorio, y juntaron á él toda la cuadrilla;
Y desnudándole, le echaron encima un manto de grana;
Y pusieron sobre su cabeza una corona tejida de espinas, y una caña en su mano derecha; é hincando la rodilla delante de él, le burlaban, diciendo: ¡Salve, Rey de los Judíos!
Y escupiendo en él, tomaron la caña, y le herían en la cabeza.
Y después que le hubieron escarnecido, le desnudaron el manto, y le vistieron de sus vestidos, y le llevaron para crucificarle.
Y saliendo, hallaron á un Cireneo, que se llamaba Simón: á éste cargaron para que llevase su cruz.
Y como llegaron al lugar que se llama Gólgotha, que es dicho, El lugar de la calavera,
Le dieron á beber vinagre mezclado con hiel; y gustando, no quiso beberlo.
Y sentados le guardaban allí.
Y pusieron sobre su cabeza su causa escrita: ESTE ES JESUS EL REY DE LOS JUDIOS.
Entonces crucificaron con él dos ladrones, uno á la derecha, y otro á la izquierda.
Y los que pasaban, le decían injurias, meneando sus cabezas,
Y diciendo: Tú, el que derribas el templo, y en tres días lo reedificas, sálvate á ti mismo: si eres Hijo de Dios, desciende de la cruz.
De esta manera también los príncipes de los sacerdotes, escarneciendo con los escribas y los Fariseos y los ancianos, decían:
A otros salvó, á sí mismo no puede salvar: si es el Rey de Israel, descienda ahora de la cruz, y creeremos en él.
Confió en Dios: líbrele ahora si le quiere: porque ha dicho: Soy Hijo de Dios.
Lo mismo también le zaherían los ladrones que estaban crucificados con él.
Y desde la hora de sexta fueron tinieblas sobre toda la tierra hasta la hora de nona.
Y cerca de la hora de nona, Jesús exclamó con grande voz, diciendo: Eli, Eli, ¿lama sabachtani? Esto es: Dios mío, Dios mío, ¿por qué me has desamparado?
Y algunos de los que estaban allí, oyéndolo, decían: A Elías llama éste.
Y luego, corriendo uno de ellos, tomó una esponja, y la hinchió de vinagre, y poniéndola en una caña, dábale de beber.
Y los otros decían: Deja, veamos si viene Elías á librarle.
Mas Jesús, habiendo otra vez exclamado con grande voz, dió el espíritu.
Y he aquí, el velo del templo se rompió en dos, de alto á bajo: y la tierra tembló, y las piedras se hendieron;
Y abriéronse los sepulcros, y muchos cuerpos de santos que habían dormido, se levantaron;
Y salidos de los sepulcros, después de su resurrección, vinieron á la santa ciudad, y aparecieron á muchos.
Y el centurión, y los que estaban con él guardando á Jesús, visto el terremoto, y las cosas que habían sido hechas, temieron en gran manera, diciendo: Verdaderamente Hijo de Dios era éste.
Y estaban allí muchas mujeres mirando de lejos, las cuales habían seguido de Galilea á Jesús, sirviéndole:
Entre las cuales estaban María Magdalena, y María la madre de Jacobo y de José, y la madre de los hijos de Zebedeo.
Y como fué la tarde del día, vino un hombre rico de Arimatea, llamado José, el cual también había sido discípulo de Jesús.
Este llegó á Pilato, y pidió el cuerpo de Jesús: entonces Pilato mandó que se le diese el cuerpo.
Y tomando José el cuerpo, lo envolvió en una sábana limpia,
Y lo puso en su sepulcro nuevo, que había labrado en la peña: y revuelta una grande piedra á la puerta del sepulcro, se fué.
Y estaban allí María Magdalena, y la otra María, sentadas delante del sepulcro.
Y el siguiente día, que es después de la preparación, se juntaron los príncipes de los sacerdotes y los Fariseos á Pilato,
Diciendo: Señor, nos acordamos que aquel engañador dijo, viviendo aún: Después de tres días resucitaré.
Y Pilato les dijo: Tenéis una guardia: id, aseguradlo como sabéis.
Y yendo ellos, aseguraron el sepulcro, sellando la piedra, con la guardia.
Y LA víspera de sábado, que amanece para el primer día de la semana, vino María Magdalena, y la otra María, á ver el sepulcro.
Y he aquí, fué hecho un gran terremoto: porque el ángel del Señor, descendiendo del cielo y llegando, había revuelto la piedra, y estaba sentado sobre ella.
Y su aspecto era como un relámpago, y su vestido blanco como la nieve.
Y de miedo de él los guardas se asombraron, y fueron vueltos como muertos.
Y respondiendo el ángel, dijo á las mujeres: No temáis vosotras; porque yo sé que buscáis á Jesús, que fué crucificado.
No está aquí; porque ha resucitado, como dijo. Venid, ved el lugar donde fué puesto el Señor.
E id presto, decid á sus discípulos que ha resucitado de los muertos: y he aquí va delante de vosotros á Galilea; allí le veréis; he aquí, os lo he dicho.
Entonces ellas, saliendo del sepulcro con temor y gran gozo, fueron corriendo á dar las nuevas á sus discípulos. Y mientras iban á dar las nuevas á sus discípulos,
He aquí, Jesús les sale al encuentro, diciendo: Salve. Y ellas se llegaron y abrazaron sus pies, y le adoraron.
Entonces Jesús les dice: No temáis: id, dad las nuevas á mis hermanos, para que vayan á Galilea, y allí me verán.
Y yendo ellas, he aquí unos de la guardia vinieron á la ciudad, y dieron aviso á los príncipes de los sacerdotes de todas las cosas que habían acontecido.
Y juntados con los ancianos, y habido consejo, dieron mucho dinero á los soldados,
Diciendo: Decid: Sus discípulos vinieron de noche, y le hurtaron, durmiendo nosotros.
Y si esto fuere oído del presidente, nosotros le persuadiremos, y os haremos seguros.
Y ellos, tomando el dinero, hicieron como estaban instruídos: y este dicho fué divulgado entre los Judíos hasta el día de hoy.
Mas los once discípulos se fueron á Galilea, al monte donde Jesús les había ordenado.
Y como le vieron, le adoraron: mas algunos dudaban.
Y llegando Jesús, les habló, diciendo: Toda potestad me es dada en el cielo y en la tierra.
Por tanto, id, y doctrinad á todos los Gentiles, bautizándolos en el nombre del Padre, y del Hijo, y del Espíritu Santo:
Enseñándoles que guarden todas las cosas que os he mandado: y he aquí, yo estoy con vosotros todos los días, hasta el fin del mundo. Amén.
PRINCIPIO del evangelio de Jesucristo, Hijo de Dios.
Como está escrito en Isaías el profeta: He aquí yo envío á mi mensajero delante de tu faz, que apareje tu camino delante de ti.
Voz del que clama en el desierto: Aparejad el camino del Señor; enderezad sus veredas.
Bautizaba Juan en el desierto, y predicaba el bautismo del arrepentimiento para remisión de pecados.
Y salía á él toda la provincia de Judea, y los de Jerusalem; y eran todos bautizados por él en el río de Jordán, confesando sus pecados.
Y Juan andaba vestido de pelos de camello, y con un cinto de cuero alrededor de sus lomos; y comía langostas y miel silvestre.
Y predicaba, diciendo: Viene tras mí el que es más poderoso que yo, al cual no soy digno de desatar encorvado la correa de sus zapatos.
Yo á la verdad os he bautizado con agua; mas él os bautizará con Espíritu Santo.
Y aconteció en aquellos días, que Jesús vino de Nazaret de Galilea, y fué bautizado por Juan en el Jordán.
Y luego, subiendo del agua, vió abrirse los cielos, y al Espíritu como paloma, que descendía sobre él.
Y hubounavoz de los cielosque decía: Tú eres mi Hijo amado; en ti tomo contentamiento.
Y luego el Espíritu le impele al desierto.
Y estuvo allí en el desierto cuarenta días, y era tentado de Satanás; y estaba con las fieras; y los ángeles le servían.
Mas después que Juan fué encarcelado, Jesús vino á Galilea predicando el evangelio del reino de Dios,
Y diciendo: El tiempo es cumplido, y el reino de Dios está cerca: arrepentíos, y creed al evangelio.
Y pasando junto á la mar de Galilea, vió á Simón, y á Andrés su hermano, que echaban la red en la mar; porque eran pescadores.
Y les dijo Jesús: Venid en pos de mí, y haré que seáis pescadores de hombres.
Y luego, dejadas sus redes, le siguieron.
Y pasando de allí un poco más adelante, vió á Jacobo, hijo de Zebedeo, y á Juan su hermano, también ellos en el navío, que aderezaban las redes.
Y luego los llamó: y dejando á su padre Zebedeo en el barco con los jornaleros, fueron en pos de él.
Y entraron en Capernaum; y luego los sábados, entrando en la sinagoga, enseñaba.
Y se admiraban de su doctrina; porque les enseñaba como quien tiene potestad, y no como los escribas.
Y había en la sinagoga de ellos un hombre con espíritu inmundo, el cual dió voces,
Diciendo: ¡Ah! ¿qué tienes con nosotros, Jesús Nazareno? ¿Has venido á destruirnos? Sé quién eres, el Santo de Dios.
Y Jesús le riñó, diciendo: Enmudece, y sal de él.
Y el espíritu inmundo, haciéndole pedazos, y clamando á gran voz, salió de él.
Y todos se maravillaron, de tal manera que inquirían entre sí, diciendo: ¿Qué es esto? ¿Qué nueva doctrina es ésta, que con potestad aun á los espíritus inmundos manda, y le obedecen?
Y vino luego su fama por toda la provincia alrededor de Galilea.
Y luego saliendo de la sinagoga, vinieron á casa de Simón y de Andrés, con Jacobo y Juan.
Y la suegra de Simón estaba acostada con calentura; y le hablaron luego de ella.
Entonces llegando él, la tomó de su mano y la levantó; y luego la dejó la calentura, y les servía.
Y cuando fué la tarde, luego que el sol se puso, traían á él todos los que tenían mal, y endemoniados;
Y toda la ciudad se juntó á la puerta.
Y sanó á muchos que estaban enfermos de diversas enfermedades, y echó fuera muchos demonios; y no dejaba decir á los demonios que le conocían.
Y levantándose muy de mañana, aun muy de noche, salió y se fué á un lugar desierto, y allí oraba.
Y le siguió Simón, y los que estaban con él;
Y hallándole, le dicen: Todos te buscan.
Y les dice: Vamos á los lugares vecinos, para que predique también allí; porque para esto he venido.
Y predicaba en las sinagogas de ellos en toda Galilea, y echaba fuera los demonios.
Y un leproso vino á él, rogándole; é hincada la rodilla, le dice: Si quieres, puedes limpiarme.
Y Jesús, teniendo misericordia de él, extendió su mano, y le tocó, y le dice: Quiero, sé limpio.
Y así que hubo él hablado, la lepra se fué luego de aquél, y fué limpio.
Entonces le apercibió, y despidióle luego,
Y le dice: Mira, no digas á nadie nada; sino ve, muéstrate al sacerdote, y ofrece por tu limpieza lo que Moisés mandó, para testimonio á ellos.
Y ENTRÓ otra vez en Capernaum después de algunos días, y se oyó que estaba en casa.
Y luego se juntaron á él muchos, que ya no cabían ni aun á la puerta; y les predicaba la palabra.
Entonces vinieron á él unos trayendo un paralítico, que era traído por cuatro.
Y como no podían llegar á él á causa del gentío, descubrieron el techo de donde estaba, y haciendo abertura, bajaron el lecho en que yacía el paralítico.
Y viendo Jesús la fe de ellos, dice al paralítico: Hijo, tus pecados te son perdonados.
Y estaban allí sentados algunos de los escribas, los cuales pensando en sus corazones,
Decían: ¿Por qué habla éste así? Blasfemias dice. ¿Quién puede perdonar pecados, sino solo Dios?
Y conociendo luego Jesús en su espíritu que pensaban así dentro de sí mismos, les dijo: ¿Por qué pensáis estas cosas en vuestros corazones?
¿Qué es más fácil, decir al paralítico: Tus pecados te son perdonados, ó decirle: Levántate, y toma tu lecho y anda?
Pues para que sepáis que el Hijo del hombre tiene potestad en la tierra de perdonar los pecados, (dice al paralítico):
A ti te digo: Levántate, y toma tu lecho, y vete á tu casa.
Entonces él se levantó luego, y tomando su lecho, se salió delante de todos, de manera que todos se asombraron, y glorificaron á Dios, diciendo: Nunca tal hemos visto.
Y volvió á salir á la mar, y toda la gente venía á él, y los enseñaba.
Y pasando, vió á Leví, hijo de Alfeo, sentado al banco de los públicos tributos, y le dice: Sígueme. Y levantándose le siguió.
Y aconteció que estando Jesús á la mesa en casa de él, muchos publicanos y pecadores estaban también á la mesa juntamente con Jesús y con sus discípulos: porque había muchos, y le habían seguido.
Y los escribas y los Fariseos, viéndole comer con los publicanos y con los pecadores, dijeron á sus discípulos: ¿Qué es esto, que él come y bebe con los publicanos y con los pecadores?
Y oyéndolo Jesús, les dice: Los sanos no tienen necesidad de médico, mas los que tienen mal. No he venido á llamar á los justos, sino á los pecadores.
Y los discípulos de Juan, y de los Fariseos ayunaban; y vienen, y le dicen: ¿Por qué los discípulos de Juan y los de los Fariseos ayunan, y tus discípulos no ayunan?
Y Jesús les dice: ¿Pueden ayunar los que están de bodas, cuando el esposo está con ellos? Entre tanto que tienen consigo al esposo no pueden ayunar.
Mas vendrán días, cuando el esposo les será quitado, y entonces en aquellos días ayunarán.
Nadie echa remiendo de paño recio en vestido viejo; de otra manera el mismo remiendo nuevo tira del viejo, y la rotura se hace peor.
Ni nadie echa vino nuevo en odres viejos; de otra manera, el vino nuevo rompe los odres, y se derrama el vino, y los odres se pierden; mas el vino nuevo en odres nuevos se ha de echar.
Y aconteció que pasando él por los sembrados en sábado, sus discípulos andando comenzaron á arrancar espigas.
Entonces los Fariseos le dijeron: He aquí, ¿por qué hacen en sábado lo que no es lícito?
Y él les dijo: ¿Nunca leísteis qué hizo David cuando tuvo necesidad, y tuvo hambre, él y los que con él estaban:
Cómo entró en la casa de Dios, siendo Abiathar sumo pontífice, y comió los panes de la proposición, de los cuales no es lícito comer sino á los sacerdotes, y aun dió á los que con él estaban?
También les dijo: El sábado por causa del hombre es hecho; no el hombre por causa del sábado.
Así que el Hijo del hombre es Señor aun del sábado.
Y OTRA vez entró en la sinagoga; y había allí un hombre que tenía una mano seca.
Y le acechaban si en sábado le sanaría, para acusarle.
Entonces dijo al hombre que tenía la mano seca: Levántate en medio.
Y les dice: ¿Es lícito hacer bien en sábado, ó hacer mal? ¿salvar la vida, ó quitarla? Mas ellos callaban.
Entonces saliendo los Fariseos, tomaron consejo con los Herodianos contra él, para matarle.
Mas Jesús se apartó á la mar con sus discípulos: y le siguió gran multitud de Galilea, y de Judea,
Y de Jerusalem, y de Idumea, y de la otra parte del Jordán. Y los de alrededor de Tiro y de Sidón, grande multitud, oyendo cuán grandes cosas hacía, vinieron á él.
Y dijo á sus discípulos que le estuviese siempre apercibida la barquilla, por causa del gentío, para que no le oprimiesen.
Porque había sanado á muchos; de manera que caían sobre él cuantos tenían plagas, por tocarle.
Y los espíritus inmundos, al verle, se postraban delante de él, y daban voces, diciendo: Tú eres el Hijo de Dios.
Mas él les reñía mucho que no le manifestasen.
Y subió al monte, y llamó á sí á los que él quiso; y vinieron á él.
Y estableció doce, para que estuviesen con él, y para enviarlos á predicar,
Y que tuviesen potestad de sanar enfermedades, y de echar fuera demonios:
A Simón, al cual puso por nombre Pedro;
Y á Jacobo, hijo de Zebedeo, y á Juan hermano de Jacobo; y les apellidó Boanerges, que es, Hijos del trueno;
Y á Andrés, y á Felipe, y á Bartolomé, y á Mateo, y á Tomás, y á Jacobo hijo de Alfeo, y á Tadeo, y á Simón el Cananita,
Y á Judas Iscariote, el que le entregó. Y vinieron á casa.
Y agolpóse de nuevo la gente, de modo que ellos ni aun podían comer pan.
Y como lo oyeron los suyos, vinieron para prenderle: porque decían: Está fuera de sí.
Y los escribas que habían venido de Jerusalem, decían que tenía á Beelzebub, y que por el príncipe de los demonios echaba fuera los demonios.
Y habiéndolos llamado, les decía en parábolas: ¿Cómo puede Satanás echar fuera á Satanás?
Y si algún reino contra sí mismo fuere dividido, no puede permanecer el tal reino.
Y si alguna casa fuere dividida contra sí misma, no puede permanecer la tal casa.
Y si Satanás se levantare contra sí mismo, y fuere dividido, no puede permanecer; antes tiene fin.
Nadie puede saquear las alhajas del valiente entrando en su casa, si antes no atare al valiente y entonces saqueará su casa.
De cierto os digo que todos los pecados serán perdonados á los hijos de los hombres, y las blasfemias cualesquiera con que blasfemaren;
Mas cualquiera que blasfemare contra el Espíritu Santo, no tiene jamás perdón, mas está expuesto á eterno juicio.
Porque decían: Tiene espíritu inmundo.
Vienen después sus hermanos y su madre, y estando fuera, enviaron á él llamándole.
Y la gente estaba sentada alrededor de él, y le dijeron: He aquí, tu madre y tus hermanos te buscan fuera.
Y él les respondió, diciendo: ¿Quién es mi madre y mis hermanos?
Y mirando á los que estaban sentados alrededor de él, dijo: He aquí mi madre y hermanos.
Porque cualquiera que hiciere la voluntad de Dios, éste es mi hermano, y mi hermana, y mi madre.
Y OTRA vez comenzó á enseñar junto á la mar, y se juntó á él mucha gente; tanto, que entrándose él en un barco, se sentó en la mar: y toda la gente estaba en tierra junto á la mar.
Y les enseñaba por parábolas muchas cosas, y les decía en su doctrina:
Oid: He aquí, el sembrador salió á sembrar.
Y aconteció sembrando, que una parte cayó junto al camino; y vinieron las aves del cielo, y la tragaron.
Y otra parte cayó en pedregales, donde no tenía mucha tierra; y luego salió, porque no tenía la tierra profunda:
Mas salido el sol, se quemó; y por cuanto no tenía raíz, se secó.
Y otra parte cayó en espinas; y subieron las espinas, y la ahogaron, y no dió fruto.
Y otra parte cayó en buena tierra, y dió fruto, que subió y creció: y llevó uno á treinta, y otro á sesenta, y otro á ciento.
Entonces les dijo: El que tiene oídos para oir, oiga.
Y cuando estuvo solo, le preguntaron los que estaban cerca de él con los doce, sobre la parábola.
Y les dijo: A vosotros es dado saber el misterio del reino de Dios; mas á los que están fuera, por parábolas todas las cosas;
Para que viendo, vean y no echen de ver; y oyendo, oigan y no entiendan: porque no se conviertan, y les sean perdonados los pecados.
Y les dijo: ¿No sabéis esta parábola? ¿Cómo, pues, entenderéis todas las parábolas?
El que siembra es el que siembra la palabra.
Y éstos son los de junto al camino: en los que la palabra es sembrada: mas después que la oyeron, luego viene Satanás, y quita la palabra que fué sembrada en sus corazones.
Y asimismo éstos son los que son sembrados en pedregales: los que cuando han oído la palabra, luego la toman con gozo;
Mas no tienen raíz en sí, antes son temporales, que en levantándose la tribulación ó la persecución por causa de la palabra, luego se escandalizan.
Y éstos son los que son sembrados entre espinas: los que oyen la palabra;
Mas los cuidados de este siglo, y el engaño de las riquezas, y las codicias que hay en las otras cosas, entrando, ahogan la palabra, y se hace infructuosa.
Y éstos son los que fueron sembrados en buena tierra: los que oyen la palabra, y la reciben, y hacen fruto, uno á treinta, otro á sesenta, y otro á ciento.
También les dijo: ¿Tráese la antorcha para ser puesta debajo del almud, ó debajo de la cama? ¿No es para ser puesta en el candelero?
Porque no hay nada oculto que no haya de ser manifestado, ni secreto que no haya de descubrirse.
Si alguno tiene oídos para oir, oiga.
Les dijo también: Mirad lo que oís: con la medida que medís, os medirán otros, y será añadido á vosotros los que oís.
Porque al que tiene, le será dado; y al que no tiene, aun lo que tiene le será quitado.
Decía más: Así es el reino de Dios, como si un hombre echa simiente en la tierra;
Y duerme, y se levanta de noche y de día, y la simiente brota y crece como él no sabe.
Porque de suyo fructifica la tierra, primero hierba, luego espiga, después grano lleno en la espiga;
Y cuando el fruto fuere producido, luego se mete la hoz, porque la siega es llegada.
Y decía: ¿A qué haremos semejante el reino de Dios? ¿ó con qué parábola le compararemos?
Es como el grano de mostaza, que, cuando se siembra en tierra, es la más pequeña de todas las simientes que hay en la tierra;
Mas después de sembrado, sube, y se hace la mayor de todas las legumbres, y echa grandes ramas, de tal manera que las aves del cielo puedan morar bajo su sombra.
Y con muchas tales parábolas les hablaba la palabra, conforme á lo que podían oir.
Y sin parábola no les hablaba; mas á sus discípulos en particular declaraba todo.
Y les dijo aquel día cuando fué tarde: Pasemos de la otra parte.
Y despachando la multitud, le tomaron como estaba, en el barco; y había también con él otros barquitos.
Y se levantó una grande tempestad de viento, y echaba las olas en el barco, de tal manera que ya se henchía.
Y él estaba en la popa, durmiendo sobre un cabezal, y le despertaron, y le dicen: ¿Maestro, no tienes cuidado que perecemos?
Y levantándose, increpó al viento, y dijo á la mar: Calla, enmudece. Y cesó el viento, y fué hecha grande bonanza.
Y á ellos dijo: ¿Por qué estáis así amedrentados? ¿Cómo no tenéis fe?
Y temieron con gran temor, y decían el uno al otro. ¿Quién es éste, que aun el viento y la mar le obedecen?
Y VINIERON de la otra parte de la mar á la provincia de los Gadarenos.
Y salido él del barco, luego le salió al encuentro, de los sepulcros, un hombre con un espíritu inmundo,
Que tenía domicilio en los sepulcros, y ni aun con cadenas le podía alguien atar;
Porque muchas veces había sido atado con grillos y cadenas, mas las cadenas habían sido hechas pedazos por él, y los grillos desmenuzados; y nadie le podía domar.
Y siempre, de día y de noche, andaba dando voces en los montes y en los sepulcros, é hiriéndose con las piedras.
Y como vió á Jesús de lejos, corrió, y le adoró.
Y clamando á gran voz, dijo: ¿Qué tienes conmigo, Jesús, Hijo del Dios Altísimo? Te conjuro por Dios que no me atormentes.
Porque le decía: Sal de este hombre, espíritu inmundo.
Y le preguntó: ¿Cómo te llamas? Y respondió diciendo: Legión me llamo; porque somos muchos.
Y le rogaba mucho que no le enviase fuera de aquella provincia.
Y estaba allí cerca del monte una grande manada de puercos paciendo.
Y le rogaron todos los demonios, diciendo: Envíanos á los puercos para que entremos en ellos.
Y luego Jesús se lo permitió. Y saliendo aquellos espíritus inmundos, entraron en los puercos, y la manada cayó por un despeñadero en la mar; los cuales eran como dos mil; y en la mar se ahogaron.
Y los que apacentaban los puercos huyeron, y dieron aviso en la ciudad y en los campos. Y salieron para ver qué era aquello que había acontecido.
Y vienen á Jesús, y ven al que había sido atormentado del demonio, y que había tenido la legión, sentado y vestido, y en su juicio cabal; y tuvieron miedo.
Y les contaron los que lo habían visto, cómo había acontecido al que había tenido el demonio, y lo de los puercos.
Y comenzaron á rogarle que se fuese de los términos de ellos.
Y entrando él en el barco, le rogaba el que había sido fatigado del demonio, para estar con él.
Mas Jesús no le permitió, sino le dijo: Vete á tu casa, á los tuyos, y cuéntales cuán grandes cosas el Señor ha hecho contigo, y cómo ha tenido misericordia de ti.
Y se fué, y comenzó á publicar en Decápolis cuán grandes cosas Jesús había hecho con él: y todos se maravillaban.
Y pasando otra vez Jesús en un barco á la otra parte, se juntó á él gran compañía; y estaba junto á la mar.
Y vino uno de los príncipes de la sinagoga, llamado Jairo; y luego que le vió, se postró á sus pies,
Y le rogaba mucho, diciendo: Mi hija está á la muerte: ven y pondrás las manos sobre ella para que sea salva, y vivirá.
Y fué con él, y le seguía gran compañía, y le apretaban.
Y una mujer que estaba con flujo de sangre doce años hacía,
Y había sufrido mucho de muchos médicos, y había gastado todo lo que tenía, y nada había aprovechado, antes le iba peor,
Como oyó hablar de Jesús, llegó por detrás entre la compañía, y tocó su vestido.
Porque decía: Si tocare tan solamente su vestido, seré salva.
Y luego la fuente de su sangre se secó; y sintió en el cuerpo que estaba sana de aquel azote.
Y luego Jesús, conociendo en sí mismo la virtud que había salido de él, volviéndose á la compañía, dijo: ¿Quién ha tocado mis vestidos?
Y le dijeron sus discípulos: Ves que la multitud te aprieta, y dices: ¿Quién me ha tocado?
Y él miraba alrededor para ver á la que había hecho esto.
Entonces la mujer, temiendo y temblando, sabiendo lo que en sí había sido hecho, vino y se postró delante de él, y le dijo toda la verdad.
Y él le dijo: Hija, tu fe te ha hecho salva: ve en paz, y queda sana de tu azote.
Hablando aún él, vinieron de casa del príncipe de la sinagoga, diciendo: Tu hija es muerta; ¿para qué fatigas más al Maestro?
Mas luego Jesús, oyendo esta razón que se decía, dijo al príncipe de la sinagoga: No temas, cree solamente.
Y no permitió que alguno viniese tras él sino Pedro, y Jacobo, y Juan hermano de Jacobo.
Y vino á casa del príncipe de la sinagoga, y vió el alboroto, los que lloraban y gemían mucho.
Y entrando, les dice: ¿Por qué alborotáis y lloráis? La muchacha no es muerta, mas duerme.
Y hacían burla de él: mas él, echados fuera todos, toma al padre y á la madre de la muchacha, y á los que estaban con él, y entra donde la muchacha estaba.
Y tomando la mano de la muchacha, le dice: Talitha cumi; que es, si lo interpretares: Muchacha, á ti digo, levántate.
Y luego la muchacha se levantó, y andaba; porque tenía doce años. Y se espantaron de grande espanto.
Mas él les mandó mucho que nadie lo supiese, y dijo que le diesen de comer.
Y SALIÓ de allí, y vino á su tierra, y le siguieron sus discípulos.
¿No es éste el carpintero, hijo de María, hermano de Jacobo, y de José, y de Judas, y de Simón? ¿No están también aquí con nosotros, sus hermanas? Y se escandalizaban en él.
Mas Jesús les decía: No hay profeta deshonrado sino en su tierra, y entre sus parientes, y en su casa.
Y no pudo hacer allí alguna maravilla; solamente sanó unos pocos enfermos, poniendo sobre ellos las manos.
Y estaba maravillado de la incredulidad de ellos. Y rodeaba las aldeas de alrededor, enseñando.
Y llamó á los doce, y comenzó á enviarlos de dos en dos: y les dió potestad sobre los espíritus inmundos.
Y les mandó que no llevasen nada para el camino, sino solamente báculo; no alforja, ni pan, ni dinero en la bolsa;
Mas que calzasen sandalias, y no vistiesen dos túnicas.
Y les decía: Donde quiera que entréis en una casa, posad en ella hasta que salgáis de allí.
Y saliendo, predicaban que los hombres se arrepintiesen.
Y echaban fuera muchos demonios, y ungían con aceite á muchos enfermos, y sanaban.
Y oyó el rey Herodes la fama de Jesús, porque su nombre se había hecho notorio; y dijo: Juan el que bautizaba, ha resucitado de los muertos, y por tanto, virtudes obran en él.
Otros decían: Elías es. Y otros decían: Profeta es, ó alguno de los profetas.
Y oyéndolo Herodes, dijo: Este es Juan el que yo degollé: él ha resucitado de los muertos.
Porque el mismo Herodes había enviado, y prendido á Juan, y le había aprisionado en la cárcel á causa de Herodías, mujer de Felipe su hermano; pues la había tomado por mujer.
Porque Juan decía á Herodes: No te es lícito tener la mujer de tu hermano.
Mas Herodías le acechaba, y deseaba matarle, y no podía:
Porque Herodes temía á Juan, sabiendo que era varón justo y santo, y le tenía respeto: y oyéndole, hacía muchas cosas; y le oía de buena gana.
Y venido un día oportuno, en que Herodes, en la fiesta de su nacimiento, daba una cena á sus príncipes y tribunos, y á los principales de Galilea;
Y entrando la hija de Herodías, y danzando, y agradando á Herodes y á los que estaban con él á la mesa, el rey dijo á la muchacha: Pídeme lo que quisieres, que yo te lo daré.
Y le juró: Todo lo que me pidieres te daré, hasta la mitad de mi reino.
Y saliendo ella, dijo á su madre: ¿Qué pediré? Y ella dijo: La cabeza de Juan Bautista.
Entonces ella entró prestamente al rey, y pidió, diciendo: Quiero que ahora mismo me des en un plato la cabeza de Juan Bautista.
Y el rey se entristeció mucho; mas á causa del juramento, y de los que estaban con él á la mesa, no quiso desecharla.
Y luego el rey, enviando uno de la guardia, mandó que fuese traída su cabeza;
El cual fué, y le degolló en la cárcel, y trajo su cabeza en un plato, y la dió á la muchacha, y la muchacha la dió á su madre.
Y oyéndolo sus discípulos, vinieron y tomaron su cuerpo, y le pusieron en un sepulcro.
Y los apóstoles se juntaron con Jesús, y le contaron todo lo que habían hecho, y lo que habían enseñado.
Y él les dijo: Venid vosotros aparte al lugar desierto, y reposad un poco. Porque eran muchos los que iban y venían, que ni aun tenían lugar de comer.
Y se fueron en un barco al lugar desierto aparte.
Y los vieron ir muchos, y le conocieron; y concurrieron allá muchos á pie de las ciudades, y llegaron antes que ellos, y se juntaron á él.
Y saliendo Jesús vió grande multitud, y tuvo compasión de ellos, porque eran como ovejas que no tenían pastor; y les comenzó á enseñar muchas cosas.
Y como ya fuese el día muy entrado, sus discípulos llegaron á él, diciendo: El lugar es desierto, y el día ya muy entrado;
Envíalos para que vayan á los cortijos y aldeas de alrededor, y compren para sí pan; porque no tienen qué comer.
Y respondiendo él, les dijo: Dadles de comer vosotros. Y le dijeron: ¿Que vayamos y compremos pan por doscientos denarios, y les demos de comer?
Y él les dice: ¿Cuántos panes tenéis? Id, y vedlo. Y sabiéndolo, dijeron: Cinco, y dos peces.
Y les mandó que hiciesen recostar á todos por partidas sobre la hierba verde.
Y se recostaron por partidas, de ciento en ciento, y de cincuenta en cincuenta.
Y tomados los cinco panes y los dos peces, mirando al cielo, bendijo, y partió los panes, y dió á sus discípulos para que los pusiesen delante: y repartió á todos los dos peces.
Y comieron todos, y se hartaron.
Y alzaron de los pedazos doce cofines llenos, y de los peces.
Y los que comieron eran cinco mil hombres.
Y luego dió priesa á sus discípulos á subir en el barco, é ir delante de él á Bethsaida de la otra parte, entre tanto que él despedía la multitud.
Y después que los hubo despedido, se fué al monte á orar.
Y como fué la tarde, el barco estaba en medio de la mar, y él solo en tierra.
Y los vió fatigados bogando, porque el viento les era contrario: y cerca de la cuarta vigilia de la noche, vino á ellos andando sobre la mar, y quería precederlos.
Y viéndole ellos, que andaba sobre la mar, pensaron que era fantasma, y dieron voces;
Porque todos le veían, y se turbaron. Mas luego habló con ellos, y les dijo: Alentaos; yo soy, no temáis.
Y subió á ellos en el barco, y calmó el viento: y ellos en gran manera estaban fuera de sí, y se maravillaban:
Porque aun no habían considerado lo de los panes, por cuanto estaban ofuscados sus corazones.
Y cuando estuvieron de la otra parte, vinieron á tierra de Genezaret, y tomaron puerto.
Y saliendo ellos del barco, luego le conocieron.
Y recorriendo toda la tierra de alrededor, comenzaron á traer de todas partes enfermos en lechos, á donde oían que estaba.
Y SE juntaron á él los Fariseos, y algunos de los escribas, que habían venido de Jerusalem;
Los cuales, viendo á algunos de sus discípulos comer pan con manos comunes, es á saber, no lavadas, loscondenaban.
(Porque los Fariseos y todos los Judíos, teniendo la tradición de los ancianos, si muchas veces no se lavan las manos, no comen.
Y le preguntaron los Fariseos y los escribas: ¿Por qué tus discípulos no andan conforme á la tradición de los ancianos, sino que comen pan con manos comunes?
Y respondiendo él, les dijo: Hipócritas, bien profetizó de vosotros Isaías, como está escrito: Este pueblo con los labios me honra, mas su corazón lejos está de mí.
Y en vano me honran, enseñando como doctrinas mandamientos de hombres.
Porque dejando el mandamiento de Dios, tenéis la tradición de los hombres; las lavaduras de los jarros y de los vasos de beber: y hacéis otras muchas cosas semejantes.
Les decía también: Bien invalidáis el mandamiento de Dios para guardar vuestra tradición.
Porque Moisés dijo: Honra á tu padre y á tu madre, y: El que maldijere al padre ó á la madre, morirá de muerte.
Y vosotros decís: Basta si dijere un hombre al padre ó la madre: Es Corbán (quiere decir, don mío á Dios) todo aquello con que pudiera valerte;
Y no le dejáis hacer más por su padre ó por su madre,
Invalidando la palabra de Dios con vuestra tradición que disteis: y muchas cosas hacéis semejantes á éstas.
Y llamando á toda la multitud, les dijo: Oidme todos, y entended:
Nada hay fuera del hombre que entre en él, que le pueda contaminar: mas lo que sale de él, aquello es lo que contamina al hombre.
Si alguno tiene oídos para oir, oiga.
Y apartado de la multitud, habiendo entrado en casa, le preguntaron sus discípulos sobre la parábola.
Y díjoles: ¿También vosotros estáis así sin entendimiento? ¿No entendéis que todo lo de fuera que entra en el hombre, no le puede contaminar;
Porque no entra en su corazón, sino en el vientre, y sale á la secreta? Esto decía, haciendo limpias todas las viandas.
Mas decía, que lo que del hombre sale, aquello contamina al hombre.
Porque de dentro, del corazón de los hombres, salen los malos pensamientos, los adulterios, las fornicaciones, los homicidios,
Los hurtos, las avaricias, las maldades, el engaño, las desvergüenzas, el ojo maligno, las injurias, la soberbia, la insensatez.
Todas estas maldades de dentro salen, y contaminan al hombre.
Y levantándose de allí, se fué á los términos de Tiro y de Sidón; y entrando en casa, quiso que nadie lo supiese; mas no pudo esconderse.
Porque una mujer, cuya hija tenía un espíritu inmundo, luego que oyó de él, vino y se echó á sus pies.
Y la mujer era Griega, Sirofenisa de nación; y le rogaba que echase fuera de su hija al demonio.
Mas Jesús le dijo: Deja primero hartarse los hijos, porque no es bien tomar el pan de los hijos y echarlo á los perrillos.
Y respondió ella, y le dijo: Sí, Señor; pero aun los perrillos debajo de la mesa, comen de las migajas de los hijos.
Entonces le dice: Por esta palabra, ve; el demonio ha salido de tu hija.
Y como fué á su casa, halló que el demonio había salido, y á la hija echada sobre la cama.
Y volviendo á salir de los términos de Tiro, vino por Sidón á la mar de Galilea, por mitad de los términos de Decápolis.
Y le traen un sordo y tartamudo, y le ruegan que le ponga la mano encima.
Y tomándole aparte de la gente, metió sus dedos en las orejas de él, y escupiendo, tocó su lengua;
Y mirando al cielo, gimió, y le dijo: Ephphatha: que es decir: Sé abierto.
Y luego fueron abiertos sus oídos, y fué desatada la ligadura de su lengua, y hablaba bien.
Y les mandó que no lo dijesen á nadie; pero cuanto más les mandaba, tanto más y más lo divulgaban.
Y en gran manera se maravillaban, diciendo: Bien lo ha hecho todo: hace á los sordos oir, y á los mudos hablar.
EN aquellos días, como hubo gran gentío, y no tenían qué comer, Jesús llamó á sus discípulos, y les dijo:
Tengo compasión de la multitud, porque ya hace tres días que están conmigo, y no tienen qué comer:
Y si los enviare en ayunas á sus casas, desmayarán en el camino; porque algunos de ellos han venido de lejos.
Y sus discípulos le respondieron: ¿De dónde podrá alguien hartar á estos de pan aquí en el desierto?
Y les preguntó: ¿Cuántos panes tenéis? Y ellos dijeron: Siete.
Tenían también unos pocos pececillos: y los bendijo, y mandó que también los pusiesen delante.
Y comieron, y se hartaron: y levantaron de los pedazos que habían sobrado, siete espuertas.
Y eran los que comieron, como cuatro mil: y los despidió.
Y luego entrando en el barco con sus discípulos, vino á las partes de Dalmanutha.
Y vinieron los Fariseos, y comenzaron á altercar con él, pidiéndole señal del cielo, tentándole.
Y gimiendo en su espíritu, dice: ¿Por qué pide señal esta generación? De cierto os digo que no se dará señal á esta generación.
Y dejándolos, volvió á entrar en el barco, y se fué de la otra parte.
Y se habían olvidado de tomar pan, y no tenían sino un pan consigo en el barco.
Y les mandó, diciendo: Mirad, guardaos de la levadura de los Fariseos, y de la levadura de Herodes.
Y altercaban los unos con los otros diciendo: Pan no tenemos.
Y como Jesús lo entendió, les dice: ¿Qué altercáis, porque no tenéis pan? ¿no consideráis ni entendéis? ¿aun tenéis endurecido vuestro corazón?
¿Teniendo ojos no veis, y teniendo oídos no oís? ¿y no os acordáis?
Cuando partí los cinco panes entre cinco mil, ¿cuántas espuertas llenas de los pedazos alzasteis? Y ellos dijeron: Doce.
Y cuando los siete panes entre cuatro mil, ¿cuántas espuertas llenas de los pedazos alzasteis? Y ellos dijeron: Siete.
Y les dijo: ¿Cómo aun no entendéis?
Y vino á Bethsaida; y le traen un ciego, y le ruegan que le tocase.
Entonces, tomando la mano del ciego, le sacó fuera de la aldea; y escupiendo en sus ojos, y poniéndole las manos encima, le preguntó si veía algo.
Y él mirando, dijo: Veo los hombres, pues veo que andan como árboles.
Luego le puso otra vez las manos sobre sus ojos, y le hizo que mirase; y fué restablecido, y vió de lejos y claramente á todos.
Y envióle á su casa, diciendo: No entres en la aldea, ni lo digas á nadie en la aldea.
Y salió Jesús y sus discípulos por las aldeas de Cesarea de Filipo. Y en el camino preguntó á sus discípulos, diciéndoles: ¿Quién dicen los hombres que soy yo?
Y ellos respondieron: Juan Bautista; y otros, Elías; y otros, Alguno de los profetas.
Entonces él les dice: Y vosotros, ¿quién decís que soy yo? Y respondiendo Pedro, le dice: Tú eres el Cristo.
Y les apercibió que no hablasen de él á ninguno.
Y claramente decía esta palabra. Entonces Pedro le tomó, y le comenzó á reprender.
Y él, volviéndose y mirando á sus discípulos, riñó á Pedro, diciendo: Apártate de mí, Satanás; porque no sabes las cosas que son de Dios, sino las que son de los hombres.
Y llamando á la gente con sus discípulos, les dijo: Cualquiera que quisiere venir en pos de mí, niéguese á sí mismo, y tome su cruz, y sígame.
Porque el que quisiere salvar su vida, la perderá; y el que perdiere su vida por causa de mí y del evangelio, la salvará.
Porque ¿qué aprovechará al hombre, si granjeare todo el mundo, y pierde su alma?
¿O qué recompensa dará el hombre por su alma?
TAMBIÉN les dijo: De cierto os digo que hay algunos de los que están aquí, que no gustarán la muerte hasta que hayan visto el reino de Dios que viene con potencia.
Y seis días después tomó Jesús á Pedro, y á Jacobo, y á Juan, y los sacó aparte solos á un monte alto; y fué transfigurado delante de ellos.
Y sus vestidos se volvieron resplandecientes, muy blancos, como la nieve; tanto que ningún lavador en la tierra los puede hacer tan blancos.
Y les apareció Elías con Moisés, que hablaban con Jesús.
Entonces respondiendo Pedro, dice á Jesús: Maestro, bien será que nos quedemos aquí, y hagamos tres pabellones: para ti uno, y para Moisés otro, y para Elías otro;
Porque no sabía lo que hablaba; que estaban espantados.
Y vino una nube que les hizo sombra, y una voz de la nube, que decía: Este es mi Hijo amado: á él oid.
Y luego, como miraron, no vieron más á nadie consigo, sino á Jesús solo.
Y descendiendo ellos del monte, les mandó que á nadie dijesen lo que habían visto, sino cuando el Hijo del hombre hubiese resucitado de los muertos.
Y retuvieron la palabra en sí, altercando qué sería aquéllo: Resucitar de los muertos.
Y le preguntaron, diciendo: ¿Qué es lo que los escribas dicen, que es necesario que Elías venga antes?
Y respondiendo él, les dijo: Elías á la verdad, viniendo antes, restituirá todas las cosas: y como está escrito del Hijo del hombre, que padezca mucho y sea tenido en nada.
Empero os digo que Elías ya vino, y le hicieron todo lo que quisieron, como está escrito de él.
Y como vino á los discípulos, vió grande compañía alrededor de ellos, y escribas que disputaban con ellos.
Y luego toda la gente, viéndole, se espantó, y corriendo á él, le saludaron.
Y preguntóles: ¿Qué disputáis con ellos?
Y respondiendo uno de la compañía, dijo: Maestro, traje á ti mi hijo, que tiene un espíritu mudo,
El cual, donde quiera que le toma, le despedaza; y echa espumarajos, y cruje los dientes, y se va secando: y dije á tus discípulos que le echasen fuera, y no pudieron.
Y respondiendo él, les dijo: ¡Oh generación infiel! ¿hasta cuándo estaré con vosotros? ¿hasta cuándo os tengo de sufrir? Traédmele.
Y se le trajeron: y como le vió, luego el espíritu le desgarraba; y cayendo en tierra, se revolcaba, echando espumarajos.
Y Jesús preguntó á su padre: ¿Cuánto tiempo há que le aconteció esto? Y él dijo: Desde niño:
Y muchas veces le echa en el fuego y en aguas, para matarle; mas, si puedes algo, ayúdanos, teniendo misericordia de nosotros.
Y Jesús le dijo: Si puedes creer, al que cree todo es posible.
Y luego el padre del muchacho dijo clamando: Creo, ayuda mi incredulidad.
Y como Jesús vió que la multitud se agolpaba, reprendió al espíritu inmundo, diciéndole: Espíritu mudo y sordo, yo te mando, sal de él, y no entres más en él.
Entonces el espíritu clamando y desgarrándole mucho, salió; y él quedó como muerto, de modo que muchos decían: Está muerto.
Mas Jesús tomándole de la mano, enderezóle; y se levantó.
Y como él entró en casa, sus discípulos le preguntaron aparte: ¿Por qué nosotros no pudimos echarle fuera?
Y les dijo: Este género con nada puede salir, sino con oración y ayuno.
Y habiendo salido de allí, caminaron por Galilea; y no quería que nadie lo supiese.
Porque enseñaba á sus discípulos, y les decía: El Hijo del hombre será entregado en manos de hombres, y le matarán; mas muerto él, resucitará al tercer día.
Pero ellos no entendían esta palabra, y tenían miedo de preguntarle.
Y llegó á Capernaum; y así que estuvo en casa, les preguntó: ¿Qué disputabais entre vosotros en el camino?
Mas ellos callaron; porque los unos con los otros habían disputado en el camino quién había de ser el mayor.
Entonces sentándose, llamó á los doce, y les dice: Si alguno quiere ser el primero, será el postrero de todos, y el servidor de todos.
Y tomando un niño, púsolo en medio de ellos; y tomándole en sus brazos, les dice:
El que recibiere en mi nombre uno de los tales niños, á mí recibe; y el que á mí recibe, no recibe á mí, mas al que me envió.
Y respondióle Juan, diciendo: Maestro, hemos visto á uno que en tu nombre echaba fuera los demonios, el cual no nos sigue; y se lo prohibimos, porque no nos sigue.
Y Jesús dijo: No se lo prohibáis; porque ninguno hay que haga milagro en mi nombre que luego pueda decir mal de mí.
Porque el que no es contra nosotros, por nosotros es.
Y cualquiera que os diere un vaso de agua en mi nombre, porque sois de Cristo, de cierto os digo que no perderá su recompensa.
Y cualquiera que escandalizare á uno de estos pequeñitos que creen en mí, mejor le fuera si se le atase una piedra de molino al cuello, y fuera echado en la mar.
Y si tu mano te escandalizare, córtala: mejor te es entrar á la vida manco, que teniendo dos manos ir á la Gehenna, al fuego que no puede ser apagado;
Donde su gusano no muere, y el fuego nunca se apaga.
Y si tu pie te fuere ocasión de caer, córtalo: mejor te es entrar á la vida cojo, que teniendo dos pies ser echado en la Gehenna, al fuego que no puede ser apagado;
Donde el gusano de ellos no muere, y el fuego nunca se apaga.
Y si tu ojo te fuere ocasión de caer, sácalo: mejor te es entrar al reino de Dios con un ojo, que teniendo dos ojos ser echado á la Gehenna;
Donde el gusano de ellos no muere, y el fuego nunca se apaga.
Porque todos serán salados con fuego, y todo sacrificio será salado con sal.
Buena es la sal; mas si la sal fuere desabrida, ¿con qué la adobaréis? Tened en vosotros mismos sal; y tened paz los unos con los otros.
Y PARTIÉNDOSE de allí, vino á los términos de Judea y tras el Jordán: y volvió el pueblo á juntarse á él; y de nuevo les enseñaba como solía.
Y llegándose los Fariseos, le preguntaron, para tentarle, si era lícito al marido repudiar á su mujer.
Mas él respondiendo, les dijo: ¿Qué os mandó Moisés?
Y ellos dijeron: Moisés permitió escribir carta de divorcio, y repudiar.
Y respondiendo Jesús, les dijo: Por la dureza de vuestro corazón os escribió este mandamiento;
Pero al principio de la creación, varón y hembra los hizo Dios.
Por esto dejará el hombre á su padre y á su madre, y se juntará á su mujer.
Y los que eran dos, serán hechos una carne: así que no son más dos, sino una carne.
Pues lo que Dios juntó, no lo aparte el hombre.
Y en casa volvieron los discípulos á preguntarle de lo mismo.
Y les dice: Cualquiera que repudiare á su mujer, y se casare con otra, comete adulterio contra ella:
Y si la mujer repudiare á su marido y se casare con otro, comete adulterio.
Y le presentaban niños para que los tocase; y los discípulos reñían á los que los presentaban.
Y viéndolo Jesús, se enojó, y les dijo: Dejad los niños venir, y no se lo estorbéis; porque de los tales es el reino de Dios.
De cierto os digo, que el que no recibiere el reino de Dios como un niño, no entrará en él.
Y tomándolos en los brazos, poniendo las manos sobre ellos, los bendecía.
Y saliendo él para ir su camino, vino uno corriendo, é hincando la rodilla delante de él, le preguntó: Maestro bueno, ¿qué haré para poseer la vida eterna?
Y Jesús le dijo: ¿Por qué me dices bueno? Ninguno hay bueno, sino sólo uno, Dios.
Los mandamientos sabes: No adulteres: No mates: No hurtes: No digas falso testimonio: No defraudes: Honra á tu padre y á tu madre.
El entonces respondiendo, le dijo: Maestro, todo esto he guardado desde mi mocedad.
Entonces Jesús mirándole, amóle, y díjole: Una cosa te falta: ve, vende todo lo que tienes, y da á los pobres, y tendrás tesoro en el cielo; y ven, sígueme, tomando tu cruz.
Mas él, entristecido por esta palabra, se fué triste, porque tenía muchas posesiones.
Entonces Jesús, mirando alrededor, dice á sus discípulos: ¡Cuán difícilmente entrarán en el reino de Dios los que tienen riquezas!
Y los discípulos se espantaron de sus palabras; mas Jesús respondiendo, les volvió á decir: ¡Hijos, cuán difícil es entrar en el reino de Dios, los que confían en las riquezas!
Más fácil es pasar un camello por el ojo de una aguja, que el rico entrar en el reino de Dios.
Y ellos se espantaban más, diciendo dentro de sí: ¿Y quién podrá salvarse?
Entonces Jesús mirándolos, dice: Para los hombres es imposible; mas para Dios, no; porque todas las cosas son posibles para Dios.
Entonces Pedro comenzó á decirle: He aquí, nosotros hemos dejado todas las cosas, y te hemos seguido.
Que no reciba cien tantos ahora en este tiempo, casas, y hermanos, y hermanas, y madres, é hijos, y heredades, con persecuciones; y en el siglo venidero la vida eterna.
Empero muchos primeros serán postreros, y postreros primeros.
He aquí subimos á Jerusalem, y el Hijo del hombre será entregado á los príncipes de los sacerdotes, y á los escribas, y le condenarán á muerte, y le entregarán á los Gentiles:
Y le escarnecerán, y le azotarán, y escupirán en él, y le matarán; mas al tercer día resucitará.
Entonces Jacobo y Juan, hijos de Zebedeo, se llegaron á él, diciendo: Maestro, querríamos que nos hagas lo que pidiéremos.
Y él les dijo: ¿Qué queréis que os haga?
Y ellos le dijeron: Danos que en tu gloria nos sentemos el uno á tu diestra, y el otro á tu siniestra.
Entonces Jesús les dijo: No sabéis lo que pedís. ¿Podéis beber del vaso que yo bebo, ó ser bautizados del bautismo de que yo soy bautizado?
Y ellos dijeron: Podemos. Y Jesús les dijo: A la verdad, del vaso que yo bebo, beberéis; y del bautismo de que yo soy bautizado, seréis bautizados.
Mas que os sentéis á mi diestra y á mi siniestra, no es mío darlo, sino á quienes está aparejado.
Y como lo oyeron los diez, comenzaron á enojarse de Jacobo y de Juan.
Mas Jesús, llamándolos, les dice: Sabéis que los que se ven ser príncipes entre las gentes, se enseñorean de ellas, y los que entre ellas son grandes, tienen sobre ellas potestad.
Mas no será así entre vosotros: antes cualquiera que quisiere hacerse grande entre vosotros, será vuestro servidor;
Y cualquiera de vosotros que quisiere hacerse el primero, será siervo de todos.
Porque el Hijo del hombre tampoco vino para ser servido, mas para servir, y dar su vida en rescate por muchos.
Entonces vienen á Jericó: y saliendo él de Jericó y sus discípulos y una gran compañía, Bartimeo el ciego, hijo de Timeo, estaba sentado junto al camino mendigando.
Y oyendo que era Jesús el Nazareno, comenzó á dar voces y decir: Jesús, Hijo de David, ten misericordia de mí.
Y muchos le reñían, que callase: mas él daba mayores voces: Hijo de David, ten misericordia de mí.
Entonces Jesús parándose, mandó llamarle: y llaman al ciego, diciéndole: Ten confianza: levántate, te llama.
El entonces, echando su capa, se levantó, y vino á Jesús.
Y respondiendo Jesús, le dice: ¿Qué quieres que te haga? Y el ciego le dice: Maestro, que cobre la vista.
Y Jesús le dijo: Ve, tu fe te ha salvado. Y luego cobró la vista, y seguía á Jesús en el camino.
Y COMO fueron cerca de Jerusalem, de Bethphagé, y de Bethania, al monte de las Olivas, envía dos de sus discípulos,
Y les dice: Id al lugar queestádelante de vosotros, y luego entrados en él, hallaréis un pollino atado, sobre el cual ningún hombre ha subido; desatadlo y traedlo.
Y si alguien os dijere: ¿Por qué hacéis eso? decid que el Señor lo ha menester: y luego lo enviará acá.
Y fueron, y hallaron el pollino atado á la puerta fuera, entre dos caminos; y le desataron.
Y unos de los que estaban allí, les dijeron: ¿Qué hacéis desatando el pollino?
Ellos entonces les dijeron como Jesús había mandado: y los dejaron.
Y trajeron el pollino á Jesús, y echaron sobre él sus vestidos, y se sentó sobre él.
Y muchos tendían sus vestidos por el camino, y otros cortaban hojas de los árboles, y las tendían por el camino.
Y los que iban delante, y los que iban detrás, daban voces diciendo: ¡Hosanna! Bendito el que viene en el nombre del Señor.
Bendito el reino de nuestro padre David que viene: ¡Hosanna en las alturas!
Y entró Jesús en Jerusalem, y en el templo: y habiendo mirado alrededor todas las cosas, y siendo ya tarde, salióse á Bethania con los doce.
Y el día siguiente, como salieron de Bethania, tuvo hambre.
Y viendo de lejos una higuera que tenía hojas, se acercó, si quizá hallaría en ella algo: y como vino á ella, nada halló sino hojas; porque no era tiempo de higos.
Entonces Jesús respondiendo, dijo á la higuera: Nunca más coma nadie fruto de ti para siempre. Y lo oyeron sus discípulos.
Y no consentía que alguien llevase vaso por el templo.
Y les enseñaba diciendo: ¿No está escrito que mi casa, casa de oración será llamada por todas las gentes? Mas vosotros la habéis hecho cueva de ladrones.
Y lo oyeron los escribas y los príncipes de los sacerdotes, y procuraban cómo le matarían; porque le tenían miedo, por cuanto todo el pueblo estaba maravillado de su doctrina.
Mas como fué tarde, Jesús salió de la ciudad.
Y pasando por la mañana, vieron que la higuera se había secado desde las raíces.
Entonces Pedro acordándose, le dice: Maestro, he aquí la higuera que maldijiste, se ha secado.
Y respondiendo Jesús, les dice: Tened fe en Dios.
Por tanto, os digo que todo lo que orando pidiereis, creed que lo recibiréis, y os vendrá.
Y cuando estuviereis orando, perdonad, si tenéis algo contra alguno, para que vuestro Padre que está en los cielos os perdone también á vosotros vuestras ofensas.
Porque si vosotros no perdonareis, tampoco vuestro Padre que está en los cielos os perdonará vuestras ofensas.
Y volvieron á Jerusalem; y andando él por el templo, vienen á él los príncipes de los sacerdotes, y los escribas, y los ancianos;
Y le dicen: ¿Con qué facultad haces estas cosas? ¿y quién te ha dado esta facultad para hacer estas cosas?
Y Jesús respondiendo entonces, les dice: Os preguntaré también yo una palabra; y respondedme, y os diré con qué facultad hago estas cosas:
El bautismo de Juan, ¿era del cielo, ó de los hombres? Respondedme.
Entonces ellos pensaron dentro de sí, diciendo: Si dijéremos, del cielo, dirá: ¿Por qué, pues, no le creísteis?
Y si dijéremos, de los hombres, tememos al pueblo: porque todos juzgaban de Juan, que verdaderamente era profeta.
Y respondiendo, dicen á Jesús: No sabemos. Entonces respondiendo Jesús, les dice: Tampoco yo os diré con qué facultad hago estas cosas.
Y COMENZÓ á hablarles por parábolas: Plantó un hombre una viña, y la cercó con seto, y cavó un lagar, y edificó una torre, y la arrendó á labradores, y se partió lejos.
Y envió un siervo á los labradores, al tiempo, para que tomase de los labradores del fruto de la viña.
Mas ellos, tomándole, le hirieron, y le enviaron vacío.
Y volvió á enviarles otro siervo; mas apedreándole, le hirieron en la cabeza, y volvieron á enviarle afrentado.
Y volvió á enviar otro, y á aquél mataron; y á otros muchos, hiriendo á unos y matando á otros.
Teniendo pues aún un hijo suyo amado, enviólo también á ellos el postrero, diciendo: Tendrán en reverencia á mi hijo.
Mas aquellos labradores dijeron entre sí: Este es el heredero; venid, matémosle, y la heredad será nuestra.
Y prendiéndole, le mataron, y echaron fuera de la viña.
¿Qué, pues, hará el señor de la viña? Vendrá, y destruirá á estos labradores, y dará su viña á otros.
¿Ni aun esta Escritura habéis leído: La piedra que desecharon los que edificaban, ésta es puesta por cabeza de esquina;
Por el Señor es hecho esto, y es cosa maravillosa en nuestros ojos?
Y procuraban prenderle, porque entendían que decía á ellos aquella parábola; mas temían á la multitud; y dejándole, se fueron.
Y envían á él algunos de los Fariseos y de los Herodianos, para que le sorprendiesen en alguna palabra.
Entonces él, como entendía la hipocresía de ellos, les dijo: ¿Por qué me tentáis? Traedme la moneda para que la vea.
Y ellos se la trajeron y les dice: ¿Cúya es esta imagen y esta inscripción? Y ellos le dijeron: De César.
Y respondiendo Jesús, les dijo: Dad lo que es de César á César; y lo que es de Dios, á Dios. Y se maravillaron de ello.
Entonces vienen á él los Saduceos, que dicen que no hay resurrección, y le preguntaron, diciendo:
Maestro, Moisés nos escribió, que si el hermano de alguno muriese, y dejase mujer, y no dejase hijos, que su hermano tome su mujer, y levante linaje á su hermano.
Fueron siete hermanos: y el primero tomó mujer, y muriendo, no dejó simiente;
Y la tomó el segundo, y murió, y ni aquél tampoco dejó simiente; y el tercero, de la misma manera.
Y la tomaron los siete, y tampoco dejaron simiente: á la postre murió también la mujer.
En la resurrección, pues, cuando resucitaren, ¿de cuál de ellos será mujer? porque los siete la tuvieron por mujer.
Entonces respondiendo Jesús, les dice: ¿No erráis por eso, porque no sabéis las Escrituras, ni la potencia de Dios?
Porque cuando resucitarán de los muertos, ni se casarán, ni serán dados en casamiento, mas son como los ángeles que están en los cielos.
Y de que los muertos hayan de resucitar, ¿no habéis leído en el libro de Moisés cómo le habló Dios en la zarza, diciendo: Yo soy el Dios de Abraham, y el Dios de Isaac, y el Dios de Jacob?
No es Dios de muertos, mas Dios de vivos; así que vosotros mucho erráis.
Y llegándose uno de los escribas, que los había oído disputar, y sabía que les había respondido bien, le preguntó: ¿Cuál es el primer mandamiento de todos?
Y Jesús le respondió: El primer mandamiento de todos es: Oye, Israel, el Señor nuestro Dios, el Señor uno es.
Amarás pues al Señor tu Dios de todo tu corazón, y de toda tu alma, y de toda tu mente, y de todas tus fuerzas; este es el principal mandamiento.
Y el segundo es semejante á él: Amarás á tu prójimo como á ti mismo. No hay otro mandamiento mayor que éstos.
Entonces el escriba le dijo: Bien, Maestro, verdad has dicho, que uno es Dios, y no hay otro fuera de él;
Jesús entonces, viendo que había respondido sabiamente, le dice: No estás lejos del reino de Dios. Y ya ninguno osaba preguntarle.
Y respondiendo Jesús decía, enseñando en el templo: ¿Cómo dicen los escribas que el Cristo es hijo de David?
Porque el mismo David dijo por el Espíritu Santo: Dijo el Señor á mi Señor: Siéntate á mi diestra, hasta que ponga tus enemigos por estrado de tus pies.
Luego llamándole el mismo David Señor, ¿de dónde, pues, es su hijo? Y los que eran del común del pueblo le oían de buena gana.
Y les decía en su doctrina: Guardaos de los escribas, que quieren andar con ropas largas, y aman las salutaciones en las plazas,
Y las primeras sillas en las sinagogas, y los primeros asientos en las cenas;
Que devoran las casas de las viudas, y por pretexto hacen largas oraciones. Estos recibirán mayor juicio.
Y estando sentado Jesús delante del arca de la ofrenda, miraba cómo el pueblo echaba dinero en el arca: y muchos ricos echaban mucho.
Y como vino una viuda pobre, echó dos blancas, que son un maravedí.
Entonces llamando á sus discípulos, les dice: De cierto os digo que esta viuda pobre echó más que todos los que han echado en el arca:
Porque todos han echado de lo que les sobra; mas ésta, de su pobreza echó todo lo que tenía, todo su alimento.
Y SALIENDO del templo, le dice uno de sus discípulos: Maestro, mira qué piedras, y qué edificios.
Y Jesús respondiendo, le dijo: ¿Ves estos grandes edificios? no quedará piedra sobre piedra que no sea derribada.
Y sentándose en el monte de las Olivas delante del templo, le preguntaron aparte Pedro y Jacobo y Juan y Andrés:
Dinos, ¿cuándo serán estas cosas? ¿y qué señal habrá cuando todas estas cosas han de cumplirse?
Y Jesús respondiéndoles, comenzó á decir: Mirad, que nadie os engañe;
Porque vendrán muchos en mi nombre, diciendo: Yo soy el Cristo; y engañarán á muchos.
Mas cuando oyereis de guerras y de rumores de guerras no os turbéis, porque conviene hacerse así; mas aun no será el fin.
Porque se levantará nación contra nación, y reino contra reino; y habrá terremotos en muchos lugares, y habrá hambres y alborotos; principios de dolores serán estos.
Mas vosotros mirad por vosotros: porque os entregarán en los concilios, y en sinagogas seréis azotados: y delante de presidentes y de reyes seréis llamados por causa de mí, en testimonio á ellos.
Y á todas las gentes conviene que el evangelio sea predicado antes.
Y entregará á la muerte el hermano al hermano, y el padre al hijo: y se levantarán los hijos contra los padres, y los matarán.
Y seréis aborrecidos de todos por mi nombre: mas el que perseverare hasta el fin, éste será salvo.
Empero cuando viereis la abominación de asolamiento, que fué dicha por el profeta Daniel, que estará donde no debe (el que lee, entienda), entonces los que estén en Judea huyan á los montes;
Y el que esté sobre el terrado, no descienda á la casa, ni entre para tomar algo de su casa;
Y el que estuviere en el campo, no vuelva atrás á tomar su capa.
Mas ¡ay de las preñadas, y de las que criaren en aquellos días!
Orad pues, que no acontezca vuestra huída en invierno.
Porque aquellos días serán de aflicción, cual nunca fué desde el principio de la creación que crió Dios, hasta este tiempo, ni será.
Y si el Señor no hubiese abreviado aquellos días, ninguna carne se salvaría; mas por causa de los escogidos que él escogió, abrevió aquellos días.
Y entonces si alguno os dijere: He aquí, aquí está el Cristo; ó, He aquí, allí está, no le creáis.
Porque se levantarán falsos Cristos y falsos profetas, y darán señales y prodigios, para engañar, si se pudiese hacer, aun á los escogidos.
Mas vosotros mirad; os lo he dicho antes todo.
Empero en aquellos días, después de aquella aflicción, el sol se obscurecerá, y la luna no dará su resplandor;
Y las estrellas caerán del cielo, y las virtudes que están en los cielos serán conmovidas;
Y entonces verán al Hijo del hombre, que vendrá en las nubes con mucha potestad y gloria.
Y entonces enviará sus ángeles, y juntará sus escogidos de los cuatro vientos, desde el cabo de la tierra hasta el cabo del cielo.
De la higuera aprended la semejanza: Cuando su rama ya se enternece, y brota hojas, conocéis que el verano está cerca:
Así también vosotros, cuando viereis hacerse estas cosas, conoced que está cerca, á las puertas.
De cierto os digo que no pasará esta generación, que todas estas cosas no sean hechas.
El cielo y la tierra pasarán, mas mis palabras no pasarán.
Empero de aquel día y de la hora, nadie sabe; ni aun los ángeles que están en el cielo, ni el Hijo, sino el Padre.
Mirad, velad y orad: porque no sabéis cuándo será el tiempo.
Como el hombre que partiéndose lejos, dejó su casa, y dió facultad á sus siervos, y á cada uno su obra, y al portero mandó que velase:
Velad pues, porque no sabéis cuándo el señor de la casa vendrá; si á la tarde, ó á la media noche, ó al canto del gallo, ó á la mañana;
Porque cuando viniere de repente, no os halle durmiendo.
Y las cosas que á vosotros digo, á todos las digo: Velad.
Y DOS días después era la Pascua ylos díasde los panes sin levadura: y procuraban los príncipes de los sacerdotes y los escribas cómo le prenderían por engaño, y le matarían.
Y decían: No en el día de la fiesta, porque no se haga alboroto del pueblo.
Y hubo algunos que se enojaron dentro de sí, y dijeron: ¿Para qué se ha hecho este desperdicio de ungüento?
Porque podía esto ser vendido por más de trescientos denarios, y darse á los pobres. Y murmuraban contra ella.
Mas Jesús dijo: Dejadla; ¿por qué la fatigáis? buena obra me ha hecho;
Que siempre tendréis los pobres con vosotros, y cuando quisiereis les podréis hacer bien; mas á mí no siempre me tendréis.
Esta ha hecho lo que podía; porque se ha anticipado á ungir mi cuerpo para la sepultura.
De cierto os digo que donde quiera que fuere predicado este evangelio en todo el mundo, también esto que ha hecho ésta, será dicho para memoria de ella.
Entonces Judas Iscariote, uno de los doce, vino á los príncipes de los sacerdotes, para entregársele.
Y ellos oyéndolo se holgaron, y prometieron que le darían dineros. Y buscaba oportunidad cómo le entregaría.
Y el primer día de los panes sin levadura, cuando sacrificaban la pascua, sus discípulos le dicen: ¿Dónde quieres que vayamos á disponer para que comas la pascua?
Y envía dos de sus discípulos, y les dice: Id á la ciudad, y os encontrará un hombre que lleva un cántaro de agua; seguidle;
Y donde entrare, decid al señor de la casa: El Maestro dice: ¿Dónde está el aposento donde he de comer la pascua con mis discípulos?
Y él os mostrará un gran cenáculo ya preparado: aderezad para nosotros allí.
Y fueron sus discípulos, y vinieron á la ciudad, y hallaron como les había dicho; y aderezaron la pascua.
Y llegada la tarde, fué con los doce.
Y como se sentaron á la mesa y comiesen, dice Jesús: De cierto os digo que uno de vosotros, que come conmigo, me ha de entregar.
Entonces ellos comenzaron á entristecerse, y á decirle cada uno por sí: ¿Seré yo? Y el otro: ¿Seré yo?
Y él respondiendo les dijo: Es uno de los doce que moja conmigo en el plato.
A la verdad el Hijo del hombre va, como está de él escrito; mas ¡ay de aquel hombre por quien el Hijo del hombre es entregado! bueno le fuera á aquel hombre si nunca hubiera nacido.
Y estando ellos comiendo, tomó Jesús pan, y bendiciendo, partió y les dió, y dijo: Tomad, esto es mi cuerpo.
Y tomando el vaso, habiendo hecho gracias, les dió: y bebieron de él todos.
Y les dice: Esto es mi sangre del nuevo pacto, que por muchos es derramada.
De cierto os digo que no beberé más del fruto de la vid, hasta aquel día cuando lo beberé nuevo en el reino de Dios.
Y como hubieron cantado el himno, se salieron al monte de las Olivas.
Jesús entonces les dice: Todos seréis escandalizados en mí esta noche; porque escrito está: Heriré al pastor, y serán derramadas las ovejas.
Mas después que haya resucitado, iré delante de vosotros á Galilea.
Entonces Pedro le dijo: Aunque todos sean escandalizados, mas no yo.
Y le dice Jesús: De cierto te digo que tú, hoy, en esta noche, antes que el gallo haya cantado dos veces, me negarás tres veces.
Mas él con mayor porfía decía: Si me fuere menester morir contigo, no te negaré. También todos decían lo mismo.
Y vienen al lugar que se llama Gethsemaní, y dice á sus discípulos: Sentaos aquí, entre tanto que yo oro.
Y toma consigo á Pedro y á Jacobo y á Juan, y comenzó á atemorizarse, y á angustiarse.
Y les dice: Está muy triste mi alma, hasta la muerte: esperad aquí y velad.
Y yéndose un poco adelante, se postró en tierra, y oró que si fuese posible, pasase de él aquella hora.
Y decía: Abba, Padre, todas las cosas son á ti posibles; traspasa de mí este vaso; empero no lo que yo quiero, sino lo que tú.
Y vino y los halló durmiendo; y dice á Pedro: ¿Simón, duermes? ¿No has podido velar una hora?
Velad y orad, para que no entréis en tentación: el espíritu á la verdad es presto, mas la carne enferma.
Y volviéndose á ir, oró, y dijo las mismas palabras.
Y vuelto, los halló otra vez durmiendo, porque los ojos de ellos estaban cargados; y no sabían qué responderle.
Y vino la tercera vez, y les dice: Dormid ya y descansad: basta, la hora es venida; he aquí, el Hijo del hombre es entregado en manos de los pecadores.
Levantaos, vamos: he aquí, el que me entrega está cerca.
Y luego, aun hablando él, vino Judas, que era uno de los doce, y con él una compañía con espadas y palos, de parte de los príncipes de los sacerdotes, y de los escribas y de los ancianos.
Y el que le entregaba les había dado señal común, diciendo: Al que yo besare, aquél es: prendedle, y llevadle con seguridad.
Y como vino, se acercó luego á él, y le dice: Maestro, Maestro. Y le besó.
Entonces ellos echaron en él sus manos, y le prendieron.
Y uno de los que estaban allí, sacando la espada, hirió al siervo del sumo sacerdote, y le cortó la oreja.
Y respondiendo Jesús, les dijo: ¿Como á ladrón habéis salido con espadas y con palos á tomarme?
Cada día estaba con vosotros enseñando en el templo, y no me tomasteis; pero es así, para que se cumplan las Escrituras.
Entonces dejándole todos sus discípulos, huyeron.
Empero un mancebillo le seguía cubierto de una sábana sobre el cuerpo desnudo; y los mancebos le prendieron:
Mas él, dejando la sábana, se huyó de ellos desnudo.
Y trajeron á Jesús al sumo sacerdote; y se juntaron á él todos los príncipes de los sacerdotes y los ancianos y los escribas.
Empero Pedro le siguió de lejos hasta dentro del patio del sumo sacerdote; y estaba sentado con los servidores, y calentándose al fuego.
Y los príncipes de los sacerdotes y todo el concilio buscaban testimonio contra Jesús, para entregarle á la muerte; mas no lo hallaban.
Porque muchos decían falso testimonio contra él; mas sus testimonios no concertaban.
Entonces levantándose unos, dieron falso testimonio contra él, diciendo:
Nosotros le hemos oído decir: Yo derribaré este templo que es hecho de mano, y en tres días edificaré otro echo sin mano.
Mas ni aun así se concertaba el testimonio de ellos.
Entonces el sumo sacerdote, levantándose en medio, preguntó á Jesús, diciendo: ¿No respondes algo? ¿Qué atestiguan éstos contra ti?
Mas él callaba, y nada respondía. El sumo sacerdote le volvió á preguntar, y le dice: ¿Eres tú el Cristo, el Hijo del Bendito?
Y Jesús le dijo: Yo soy; y veréis al Hijo del hombre sentado á la diestra de la potencia de Dios, y viniendo en las nubes del cielo.
Entonces el sumo sacerdote, rasgando sus vestidos, dijo: ¿Qué más tenemos necesidad de testigos?
Oído habéis la blasfemia: ¿qué os parece? Y ellos todos le condenaron ser culpado de muerte.
Y algunos comenzaron á escupir en él, y cubrir su rostro, y á darle bofetadas, y decirle: Profetiza. Y los servidores le herían de bofetadas.
Y estando Pedro abajo en el atrio, vino una de las criadas del sumo sacerdote;
Y como vió á Pedro que se calentaba, mirándole, dice: Y tú con Jesús el Nazareno estabas.
Mas él negó, diciendo: No conozco, ni sé lo que dices. Y se salió fuera á la entrada; y cantó el gallo.
Y la criada viéndole otra vez, comenzó á decir á los que estaban allí: Este es de ellos.
Mas él negó otra vez. Y poco después, los que estaban allí dijeron otra vez á Pedro: Verdaderamente tú eres de ellos; porque eres Galileo, y tu habla es semejante.
Y él comenzó á maldecir y á jurar: No conozco á este hombre de quien habláis.
Y el gallo cantó la segunda vez: y Pedro se acordó de las palabras que Jesús le había dicho: Antes que el gallo cante dos veces, me negarás tres veces. Y pensando en esto, lloraba.
Y LUEGO por la mañana, habiendo tenido consejo los príncipes de los sacerdotes con los ancianos, y con los escribas, y con todo el concilio, llevaron á Jesús atado, y le entregaron á Pilato.
Y Pilato le preguntó: ¿Eres tú el Rey de los Judíos? Y respondiendo él, le dijo: Tú lo dices.
Y los príncipes de los sacerdotes le acusaban mucho.
Y le preguntó otra vez Pilato, diciendo: ¿No respondes algo? Mira de cuántas cosas te acusan.
Mas Jesús ni aun con eso respondió; de modo que Pilato se maravillaba.
Empero en el día de la fiesta les soltaba un preso, cualquiera que pidiesen.
Y había uno, que se llamaba Barrabás, preso con sus compañeros de motín que habían hecho muerte en una revuelta.
Y viniendo la multitud, comenzó á pedir hiciese como siempre les había hecho.
Y Pilato les respondió, diciendo: ¿Queréis que os suelte al Rey de los Judíos?
Porque conocía que por envidia le habían entregado los príncipes de los sacerdotes.
Mas los príncipes de los sacerdotes incitaron á la multitud, que les soltase antes á Barrabás.
Y respondiendo Pilato, les dice otra vez: ¿Qué pues queréis que haga del que llamáis Rey de los Judíos?
Y ellos volvieron á dar voces: Crucifícale.
Mas Pilato les decía: ¿Pues qué mal ha hecho? Y ellos daban más voces: Crucifícale.
Y Pilato, queriendo satisfacer al pueblo, les soltó á Barrabás, y entregó á Jesús, después de azotarle, para que fuese crucificado.
Entonces los soldados le llevaron dentro de la sala, es á saber, al Pretorio; y convocan toda la cohorte.
Y le visten de púrpura; y poniéndole una corona tejida de espinas,
Comenzaron luego á saludarle: ¡Salve, Rey de los Judíos!
Y le herían en la cabeza con una caña, y escupían en él, y le adoraban hincadas las rodillas.
Y cuando le hubieron escarnecido, le desnudaron la púrpura, y le vistieron sus propios vestidos, y le sacaron para crucificarle.
Y cargaron á uno que pasaba, Simón Cireneo, padre de Alejandro y de Rufo, que venía del campo, para que llevase su cruz.
Y le llevan al lugar de Gólgotha, que declarado quiere decir: Lugar de la Calavera.
Y le dieron á beber vino mezclado con mirra; mas él no lo tomó.
Y cuando le hubieron crucificado, repartieron sus vestidos, echando suertes sobre ellos, qué llevaría cada uno.
Y era la hora de las tres cuando le crucificaron.
Y el título escrito de su causa era: EL REY DE LOS JUDIOS.
Y crucificaron con él dos ladrones, uno á su derecha, y el otro á su izquierda.
Y se cumplió la Escritura, que dice: Y con los inicuos fué contado.
Y los que pasaban le denostaban, meneando sus cabezas, y diciendo: ¡Ah! tú que derribas el templo de Dios, y en tres días lo edificas,
Sálvate á ti mismo, y desciende de la cruz.
Y de esta manera también los príncipes de los sacerdotes escarneciendo, decían unos á otros, con los escribas: A otros salvó, á sí mismo no se puede salvar.
El Cristo, Rey de Israel, descienda ahora de la cruz, para que veamos y creamos. También los que estaban crucificados con él le denostaban.
Y cuando vino la hora de sexta, fueron hechas tinieblas sobre toda la tierra hasta la hora de nona.
Y á la hora de nona, exclamó Jesús á gran voz, diciendo: Eloi, Eloi, ¿lama sabachthani? que declarado, quiere decir: Dios mío, Dios mío, ¿por qué me has desamparado?
Y oyéndole unos de los que estaban allí, decían: He aquí, llama á Elías.
Y corrió uno, y empapando una esponja en vinagre, y poniéndola en una caña, le dió á beber, diciendo: Dejad, veamos si vendrá Elías á quitarle.
Mas Jesús, dando una grande voz, espiró.
Entonces el velo del templo se rasgó en dos, de alto á bajo.
Y el centurión que estaba delante de él, viendo que había espirado así clamando, dijo: Verdaderamente este hombre era el Hijo de Dios.
Y también estaban algunas mujeres mirando de lejos; entre las cuales estaba María Magdalena, y María la madre de Jacobo el menor y de José, y Salomé;
Las cuales, estando aún él en Galilea, le habían seguido, y le servían; y otras muchas que juntamente con él habían subido á Jerusalem.
Y cuando fué la tarde, porque era la preparación, es decir, la víspera del sábado,
José de Arimatea, senador noble, que también esperaba el reino de Dios, vino, y osadamente entró á Pilato, y pidió el cuerpo de Jesús.
Y Pilato se maravilló que ya fuese muerto; y haciendo venir al centurión, preguntóle si era ya muerto.
Y enterado del centurión, dió el cuerpo á José:
El cual compró una sábana, y quitándole, le envolvió en la sábana: y le puso en un sepulcro que estaba cavado en una peña; y revolvió una piedra á la puerta del sepulcro.
Y María Magdalena, y María madre de José, miraban donde era puesto.
Y COMO pasó el sábado, María Magdalena, y Maríamadrede Jacobo, y Salomé, comprarondrogasaromáticas, para venir á ungirle.
Y muy de mañana, el primerdíade la semana, vienen al sepulcro, yasalido el sol.
Y decían entre sí: ¿Quién nos revolverá la piedra de la puerta del sepulcro?
Y como miraron, ven la piedra revuelta; que era muy grande.
Y entradas en el sepulcro, vieron un mancebo sentado al lado derecho, cubierto de una larga ropa blanca; y se espantaron.
Mas él les dice: No os asustéis: buscáis á Jesús Nazareno, el que fué crucificado; resucitado há, no está aquí; he aquí el lugar en donde le pusieron.
Mas id, decid á sus discípulos y á Pedro, que él va antes que vosotros á Galilea: allí le veréis, como os dijo.
Y ellas se fueron huyendo del sepulcro; porque las había tomado temblor y espanto; ni decían nada á nadie, porque tenían miedo.
Mas como Jesús resucitó por la mañana, el primer día de la semana, apareció primeramente á María Magdalena, de la cual había echado siete demonios.
Yendo ella, lo hizo saber á los que habían estado con él, que estaban tristes y llorando.
Y ellos como oyeron que vivía, y que había sido visto de ella, no lo creyeron.
Mas después apareció en otra forma á dos de ellos que iban caminando, yendo al campo.
Y ellos fueron, y lo hicieron saber á los otros; y ni aun á ellos creyeron.
Y les dijo: Id por todo el mundo; predicad el evangelio á toda criatura.
El que creyere y fuere bautizado, será salvo; mas el que no creyere, será condenado.
Y estas señales seguirán á los que creyeren: En mi nombre echarán fuera demonios; hablarán nuevas lenguas;
Quitarán serpientes, y si bebieren cosa mortífera, no les dañará; sobre los enfermos pondrán sus manos, y sanarán.
Y el Señor, después que les habló, fué recibido arriba en el cielo, y sentóse á la diestra de Dios.
Y ellos, saliendo, predicaron en todas partes, obrando con ellos el Señor, y confirmando la palabra con las señales que se seguían. Amén.
HABIENDO muchos tentado á poner en orden la historia de las cosas que entre nosotros han sido ciertísimas,
Como nos lo enseñaron los que desde el principio lo vieron por sus ojos, y fueron ministros de la palabra;
Me ha parecido también á mí, después de haber entendido todas las cosas desde el principio con diligencia, escribírtelas por orden, oh muy buen Teófilo,
Para que conozcas la verdad de las cosas en las cuales has sido enseñado.
HUBO en los días de Herodes, rey de Judea, un sacerdote llamado Zacarías, de la suerte de Abías; y su mujer, de las hijas de Aarón, llamada Elisabet.
Y eran ambos justos delante de Dios, andando sin reprensión en todos los mandamientos y estatutos del Señor.
Y no tenían hijo, porque Elisabet era estéril, y ambos eran avanzados en días.
Y aconteció que ejerciendo Zacarías el sacerdocio delante de Dios por el orden de su vez,
Conforme á la costumbre del sacerdocio, salió en suerte á poner el incienso, entrando en el templo del Señor.
Y toda la multitud del pueblo estaba fuera orando á la hora del incienso.
Y se le apareció el ángel del Señor puesto en pie á la derecha del altar del incienso.
Y se turbó Zacarías viéndole, y cayó temor sobre él.
Mas el ángel le dijo: Zacarías, no temas; porque tu oración ha sido oída, y tu mujer Elisabet te parirá un hijo, y llamarás su nombre Juan.
Y tendrás gozo y alegría, y muchos se gozarán de su nacimiento.
Porque será grande delante de Dios, y no beberá vino ni sidra; y será lleno del Espíritu Santo, aun desde el seno de su madre.
Y á muchos de los hijos de Israel convertirá al Señor Dios de ellos.
Y dijo Zacarías al ángel: ¿En qué conoceré esto? porque yo soy viejo, y mi mujer avanzada en días.
Y respondiendo el ángel le dijo: Yo soy Gabriel, que estoy delante de Dios; y soy enviado á hablarte, y á darte estas buenas nuevas.
Y he aquí estarás mudo y no podrás hablar, hasta el día que esto sea hecho, por cuanto no creíste á mis palabras, las cuales se cumplirán á su tiempo.
Y el pueblo estaba esperando á Zacarías, y se maravillaban de que él se detuviese en el templo.
Y saliendo, no les podía hablar: y entendieron que había visto visión en el templo: y él les hablaba por señas, y quedó mudo.
Y fué, que cumplidos los días de su oficio, se vino á su casa.
Y después de aquellos días concibió su mujer Elisabet, y se encubrió por cinco meses, diciendo:
Porque el Señor me ha hecho así en los días en que miró para quitar mi afrenta entre los hombres.
Y al sexto mes, el ángel Gabriel fué enviado de Dios á una ciudad de Galilea, llamada Nazaret,
A una virgen desposada con un varón que se llamaba José, de la casa de David: y el nombre de la virgen era María.
Y entrando el ángel á donde estaba, dijo, ¡Salve, muy favorecida! el Señor es contigo: bendita tú entre las mujeres.
Mas ella, cuando le vió, se turbó de sus palabras, y pensaba qué salutación fuese ésta.
Entonces el ángel le dijo: María, no temas, porque has hallado gracia cerca de Dios.
Y he aquí, concebirás en tu seno, y parirás un hijo, y llamarás su nombre JESUS.
Este será grande, y será llamado Hijo del Altísimo: y le dará el Señor Dios el trono de David su padre:
Y reinará en la casa de Jacob por siempre; y de su reino no habrá fin.
Entonces María dijo al ángel: ¿Cómo será esto? porque no conozco varón.
Y respondiendo el ángel le dijo: El Espíritu Santo vendrá sobre ti, y la virtud del Altísimo te hará sombra; por lo cual también lo Santo que nacerá, será llamado Hijo de Dios.
Y he aquí, Elisabet tu parienta, también ella ha concebido hijo en su vejez; y este es el sexto mes á ella que es llamada la estéril:
Porque ninguna cosa es imposible para Dios.
Entonces María dijo: He aquí la sierva del Señor; hágase á mí conforme á tu palabra. Y el ángel partió de ella.
En aquellos días levantándose María, fué á la montaña con priesa, á una ciudad de Judá;
Y entró en casa de Zacarías, y saludó á Elisabet.
Y aconteció, que como oyó Elisabet la salutación de María, la criatura saltó en su vientre; y Elisabet fué llena del Espíritu Santo,
Y exclamó á gran voz, y dijo: Bendita tú entre las mujeres, y bendito el fruto de tu vientre.
¿Y de dónde esto á mí, que la madre de mi Señor venga á mí?
Porque he aquí, como llegó la voz de tu salutación á mis oídos, la criatura saltó de alegría en mi vientre.
Y bienaventurada la que creyó, porque se cumplirán las cosas que le fueron dichas de parte del Señor.
Entonces María dijo: engrandece mi alma al Señor;
Y mi espíritu se alegró en Dios mi Salvador.
Porque ha mirado á la bajeza de su criada; porque he aquí, desde ahora me dirán bienaventurada todas las generaciones.
Porque me ha hecho grandes cosas el Poderoso; y santo es su nombre.
Y su misericordia de generación á generación á los que le temen.
Hizo valentía con su brazo: esparció los soberbios del pensamiento de su corazón.
Quitó los poderosos de los tronos, y levantó á los humildes.
A los hambrientos hinchió de bienes; y á los ricos envió vacíos.
Recibió á Israel su siervo, acordándose de la misericordia,
Como habló á nuestros padres á Abraham y á su simiente para siempre.
Y se quedó María con ella como tres meses: después se volvió á su casa.
Y á Elisabet se le cumplió el tiempo de parir, y parió un hijo.
Y oyeron los vecinos y los parientes que Dios había hecho con ella grande misericordia, y se alegraron con ella.
Y aconteció, que al octavo día vinieron para circuncidar al niño; y le llamaban del nombre de su padre, Zacarías.
Y respondiendo su madre, dijo: No; sino Juan será llamado.
Y le dijeron: ¿Por qué? nadie hay en tu parentela que se llame de este nombre.
Y hablaron por señas á su padre, cómo le quería llamar.
Y demandando la tablilla, escribió, diciendo: Juan es su nombre. Y todos se maravillaron.
Y luego fué abierta su boca y su lengua, y habló bendiciendo á Dios.
Y fué un temor sobre todos los vecinos de ellos; y en todas las montañas de Judea fueron divulgadas todas estas cosas.
Y todos los que las oían, las conservaban en su corazón, diciendo: ¿Quién será este niño? Y la mano del Señor estaba con él.
Y Zacarías su padre fué lleno de Espíritu Santo, y profetizó, diciendo:
Bendito el Señor Dios de Israel, que ha visitado y hecho redención á su pueblo,
Y nos alzó un cuerno de salvación en la casa de David su siervo,
Como habló por boca de sus santos profetas que fueron desde el principio:
Salvación de nuestros enemigos, y de mano de todos los que nos aborrecieron;
Para hacer misericordia con nuestros padres, y acordándose de su santo pacto;
Del juramento que juró á Abraham nuestro padre, que nos había de dar,
Que sin temor librados de nuestros enemigos, le serviríamos
En santidad y en justicia delante de él, todos los días nuestros.
Y tú, niño, profeta del Altísimo serás llamado; porque irás ante la faz del Señor, para aparejar sus caminos;
Dando conocimiento de salud á su pueblo, para remisión de sus pecados,
Por las entrañas de misericordia de nuestro Dios, con que nos visitó de lo alto el Oriente,
Para dar luz á los que habitan en tinieblas y en sombra de muerte; para encaminar nuestros pies por camino de paz.
Y el niño crecía, y se fortalecía en espíritu: y estuvo en los desiertos hasta el día que se mostró á Israel.
Y ACONTECIÓ en aquellos días que salió edicto de parte de Augusto César, que toda la tierra fuese empadronada.
Este empadronamiento primero fué hecho siendo Cirenio gobernador de la Siria.
E iban todos para ser empadronados, cada uno á su ciudad.
Y subió José de Galilea, de la ciudad de Nazaret, á Judea, á la ciudad de David, que se llama Bethlehem, por cuanto era de la casa y familia de David;
Para ser empadronado con María su mujer, desposada con él, la cual estaba en cinta.
Y aconteció que estando ellos allí, se cumplieron los días en que ella había de parir.
Y parió á su hijo primogénito, y le envolvió en pañales, y acostóle en un pesebre, porque no había lugar para ellos en el mesón.
Y había pastores en la misma tierra, que velaban y guardaban las vigilias de la noche sobre su ganado.
Y he aquí el ángel del Señor vino sobre ellos, y la claridad de Dios los cercó de resplandor; y tuvieron gran temor.
Mas el ángel les dijo: No temáis; porque he aquí os doy nuevas de gran gozo, que será para todo el pueblo:
Que os ha nacido hoy, en la ciudad de David, un Salvador, que es CRISTO el Señor.
Y esto os será por señal: hallaréis al niño envuelto en pañales, echado en un pesebre.
Y repentinamente fué con el ángel una multitud de los ejércitos celestiales, que alababan á Dios, y decían:
Gloria en las alturas á Dios, y en la tierra paz, buena voluntad para con los hombres.
Y aconteció que como los ángeles se fueron de ellos al cielo, los pastores dijeron los unos á los otros: Pasemos pues hasta Bethlehem, y veamos esto que ha sucedido, que el Señor nos ha manifestado.
Y vinieron apriesa, y hallaron á María, y á José, y al niño acostado en el pesebre.
Y viéndolo, hicieron notorio lo que les había sido dicho del niño.
Y todos los que oyeron, se maravillaron de lo que los pastores les decían.
Mas María guardaba todas estas cosas, confiriéndolas en su corazón.
Y se volvieron los pastores glorificando y alabando á Dios de todas las cosas que habían oído y visto, como les había sido dicho.
Y pasados los ocho días para circuncidar al niño, llamaron su nombre JESÚS; el cual le fué puesto por el ángel antes que él fuese concebido en el vientre.
Y como se cumplieron los días de la purificación de ella, conforme á la ley de Moisés, le trajeron á Jerusalem para presentarle al Señor,
(Como está escrito en la ley del Señor: Todo varón que abriere la matriz, será llamado santo al Señor),
Y para dar la ofrenda, conforme á lo que está dicho en la ley del Señor: un par de tórtolas, ó dos palominos.
Y he aquí, había un hombre en Jerusalem, llamado Simeón, y este hombre, justo y pío, esperaba la consolación de Israel: y el Espíritu Santo era sobre él.
Y había recibido respuesta del Espíritu Santo, que no vería la muerte antes que viese al Cristo del Señor.
Y vino por Espíritu al templo. Y cuando metieron al niño Jesús sus padres en el templo, para hacer por él conforme á la costumbre de la ley,
Entonces él le tomó en sus brazos, y bendijo á Dios, y dijo:
Ahora despides, Señor, á tu siervo, conforme á tu palabra, en paz;
Porque han visto mis ojos tu salvación,
La cual has aparejado en presencia de todos los pueblos;
Luz para ser revelada á los Gentiles, y la gloria de tu pueblo Israel.
Y José y su madre estaban maravillados de las cosas que se decían de él.
Y los bendijo Simeón, y dijo á su madre María: He aquí, éste es puesto para caída y para levantamiento de muchos en Israel; y para señal á la que será contradicho;
Y una espada traspasará tu alma de ti misma, para que sean manifestados los pensamientos de muchos corazones.
Estaba también allí Ana, profetisa, hija de Phanuel, de la tribu de Aser; la cual había venido en grande edad, y había vivido con su marido siete años desde su virginidad;
Y era viuda de hasta ochenta y cuatro años, que no se apartaba del templo, sirviendo de noche y de día con ayunos y oraciones.
Y ésta, sobreviniendo en la misma hora, juntamente confesaba al Señor, y hablaba de él á todos los que esperaban la redención en Jerusalem.
Mas como cumplieron todas las cosas según la ley del Señor, se volvieron á Galilea, á su ciudad de Nazaret.
Y el niño crecía, y fortalecíase, y se henchía de sabiduría; y la gracia de Dios era sobre él.
E iban sus padres todos los años á Jerusalem en la fiesta de la Pascua.
Y cuando fué de doce años, subieron ellos á Jerusalem conforme á la costumbre del día de la fiesta.
Y acabados los días, volviendo ellos, se quedó el niño Jesús en Jerusalem, sin saberlo José y su madre.
Y pensando que estaba en la compañía, anduvieron camino de un día; y le buscaban entre los parientes y entre los conocidos:
Mas como no le hallasen, volvieron á Jerusalem buscándole.
Y aconteció, que tres días después le hallaron en el templo, sentado en medio de los doctores, oyéndoles y preguntándoles.
Y todos los que le oían, se pasmaban de su entendimiento y de sus respuestas.
Y cuando le vieron, se maravillaron; y díjole su madre: Hijo, ¿por qué nos has hecho así? He aquí, tu padre y yo te hemos buscado con dolor.
Entonces él les dice: ¿Qué hay? ¿por qué me buscabais? ¿No sabíais que en los negocios de mi Padre me conviene estar?
Mas ellos no entendieron las palabras que les habló.
Y descendió con ellos, y vino á Nazaret, y estaba sujeto á ellos. Y su madre guardaba todas estas cosas en su corazón.
Y Jesús crecía en sabiduría, y en edad, y en gracia para con Dios y los hombres.
Siendo sumos sacerdotes Anás y Caifás, vino palabra del Señor sobre Juan, hijo de Zacarías, en el desierto.
Y él vino por toda la tierra al rededor del Jordán predicando el bautismo del arrepentimiento para la remisión de pecados;
Como está escrito en el libro de las palabras del profeta Isaías que dice: Voz del que clama en el desierto: Aparejad el camino del Señor, haced derechas sus sendas.
Todo valle se henchirá, y bajaráse todo monte y collado; y los caminos torcidos serán enderezados, y los caminos ásperos allanados;
Y verá toda carne la salvación de Dios.
Y decía á las gentes que salían para ser bautizadas de él: ¡Oh generación de víboras, quién os enseñó á huir de la ira que vendrá?
Y ya también el hacha está puesta á la raíz de los árboles: todo árbol pues que no hace buen fruto, es cortado, y echado en el fuego.
Y las gentes le preguntaban, diciendo: ¿Pues qué haremos?
Y respondiendo, les dijo: El que tiene dos túnicas, dé al que no tiene; y el que tiene qué comer, haga lo mismo.
Y vinieron también publicanos para ser bautizados, y le dijeron: Maestro, ¿qué haremos?
Y él les dijo: No exijáis más de lo que os está ordenado.
Y le preguntaron también los soldados, diciendo: Y nosotros, ¿qué haremos? Y les dice: No hagáis extorsión á nadie, ni calumniéis; y contentaos con vuestras pagas.
Y estando el pueblo esperando, y pensando todos de Juan en sus corazones, si él fuese el Cristo,
Cuyo bieldo está en su mano, y limpiará su era, y juntará el trigo en su alfolí, y la paja quemará en fuego que nunca se apagará.
Y amonestando, otras muchas cosas también anunciaba al pueblo.
Entonces Herodes el tetrarca, siendo reprendido por él á causa de Herodías, mujer de Felipe su hermano, y de todas las maldades que había hecho Herodes,
Añadió también esto sobre todo, que encerró á Juan en la cárcel.
Y aconteció que, como todo el pueblo se bautizaba, también Jesús fué bautizado; y orando, el cielo se abrió,
Y descendió el Espíritu Santo sobre él en forma corporal, como paloma, y fué hecha una voz del cielo que decía: Tú eres mi Hijo amado, en ti me he complacido.
Y el mismo Jesús comenzaba á ser como de treinta años, hijo de José, como se creía; que fué hijo de Elí,
Que fué de Mathat, que fué de Leví, que fué de Melchî, que fué de Janna, que fué de José,
Que fué de Mattathías, que fué de Amós, que fué de Nahum, que fué de Esli,
Que fué de Naggai, que fué de Maat, que fué de Mattathías, que fué de Semei, que fué de José, que fué de Judá,
Que fué de Joanna, que fué de Rhesa, que fué de Zorobabel, que fué de Salathiel,
Que fué de Neri, que fué de Melchî, que fué de Abdi, que fué de Cosam, que fué de Elmodam, que fué de Er,
Que fué de Josué, que fué de Eliezer, que fué de Joreim, que fué de Mathat,
Que fué de Leví, que fué de Simeón, que fué de Judá, que fué de José, que fué de Jonán, que fué de Eliachîm,
Que fué de Melea, que fué de Mainán, que fué de Mattatha, que fué de Nathán,
Que fué de David, que fué de Jessé, que fué de Obed, que fué de Booz, que fué de Salmón, que fué de Naassón,
Que fué de Aminadab, que fué de Aram, que fué de Esrom, que fué de Phares,
Que fué de Judá, que fué de Jacob, que fué de Isaac, que fué de Abraham, que fué de Thara, que fué de Nachôr,
Que fué de Saruch, que fué de Ragau, que fué de Phalec, que fué de Heber,
Que fué de Sala, que fué de Cainán, que fué de Arphaxad, que fué de Sem, que fué de Noé, que fué de Lamech,
Que fué de Mathusala, que fué de Enoch, que fué de Jared, que fué de Maleleel,
Que fué de Cainán, que fué de Enós, que fué de Seth, que fué de Adam, que fué de Dios.
Y JESÚS, lleno del Espíritu Santo, volvió del Jordán, y fué llevado por el Espíritu al desierto
Por cuarenta días, y era tentado del diablo. Y no comió cosa en aquellos días: los cuales pasados, tuvo hambre.
Entonces el diablo le dijo: Si eres Hijo de Dios, di á esta piedra que se haga pan.
Y Jesús respondiéndole, dijo: Escrito está: Que no con pan solo vivirá el hombre, mas con toda palabra de Dios.
Y le llevó el diablo á un alto monte, y le mostró en un momento de tiempo todos los reinos de la tierra.
Y le dijo el diablo: A ti te daré toda esta potestad, y la gloria de ellos; porque á mí es entregada, y á quien quiero la doy:
Pues si tú adorares delante de mí, serán todos tuyos.
Y respondiendo Jesús, le dijo: Vete de mí, Satanás, porque escrito está: A tu Señor Dios adorarás, y á él solo servirás.
Y le llevó á Jerusalem, y púsole sobre las almenas del templo, y le dijo: Si eres Hijo de Dios, échate de aquí abajo:
Porque escrito está: Que á sus ángeles mandará de ti, que te guarden;
Y en las manos te llevarán, porque no dañes tu pie en piedra.
Y respondiendo Jesús, le dijo: Dicho está: No tentarás al Señor tu Dios.
Y acabada toda tentación, el diablo se fué de él por un tiempo.
Y Jesús volvió en virtud del Espíritu á Galilea, y salió la fama de él por toda la tierra de alrededor.
Y enseñaba en las sinagogas de ellos, y era glorificado de todos.
Y vino á Nazaret, donde había sido criado; y entró, conforme á su costumbre, el día del sábado en la sinagoga, y se levantó á leer.
Y fuéle dado el libro del profeta Isaías; y como abrió el libro, halló el lugar donde estaba escrito:
Para predicar el año agradable del Señor.
Y rollando el libro, lo dió al ministro, y sentóse: y los ojos de todos en la sinagoga estaban fijos en él.
Y comenzó á decirles: Hoy se ha cumplido esta Escritura en vuestros oídos.
Y todos le daban testimonio, y estaban maravillados de las palabras de gracia que salían de su boca, y decían: ¿No es éste el hijo de José?
Y les dijo: Sin duda me diréis este refrán: Médico, cúrate á ti mismo: de tantas cosas que hemos oído haber sido hechas en Capernaum, haz también aquí en tu tierra.
Y dijo: De cierto os digo, que ningún profeta es acepto en su tierra.
Mas en verdad os digo, que muchas viudas había en Israel en los días de Elías, cuando el cielo fué cerrado por tres años y seis meses, que hubo una grande hambre en toda la tierra;
Pero á ninguna de ellas fué enviado Elías, sino á Sarepta de Sidón, á una mujer viuda.
Y muchos leprosos había en Israel en tiempo del profeta Eliseo; mas ninguno de ellos fué limpio, sino Naamán el Siro.
Entonces todos en la sinagoga fueron llenos de ira, oyendo estas cosas;
Y levantándose, le echaron fuera de la ciudad, y le llevaron hasta la cumbre del monte sobre el cual la ciudad de ellos estaba edificada, para despeñarle.
Mas él, pasando por medio de ellos, se fué.
Y descendió á Capernaum, ciudad de Galilea. Y los enseñaba en los sábados.
Y se maravillaban de su doctrina, porque su palabra era con potestad.
Y estaba en la sinagoga un hombre que tenía un espíritu de un demonio inmundo, el cual exclamó á gran voz,
Diciendo: Déjanos, ¿qué tenemos contigo, Jesús Nazareno? ¿has venido á destruirnos? Yo te conozco quién eres, el Santo de Dios.
Y Jesús le increpó, diciendo: Enmudece, y sal de él. Entonces el demonio, derribándole en medio, salió de él, y no le hizo daño alguno.
Y hubo espanto en todos, y hablaban unos á otros, diciendo: ¿Qué palabra es ésta, que con autoridad y potencia manda á los espíritus inmundos, y salen?
Y la fama de él se divulgaba de todas partes por todos los lugares de la comarca.
Y levantándose Jesús de la sinagoga, entró en casa de Simón: y la suegra de Simón estaba con una grande fiebre; y le rogaron por ella.
E inclinándose hacia ella, riñó á la fiebre; y la fiebre la dejó; y ella levantándose luego, les servía.
Y poniéndose el sol, todos los que tenían enfermos de diversas enfermedades, los traían á él; y él, poniendo las manos sobre cada uno de ellos, los sanaba.
Y salían también demonios de muchos, dando voces, y diciendo: Tú eres el Hijo de Dios. Mas riñéndolos no les dejaba hablar; porque sabían que él era el Cristo.
Y siendo ya de día salió, y se fué á un lugar desierto: y las gentes le buscaban, y vinieron hasta él; y le detenían para que no se apartase de ellos.
Mas él les dijo: Que también á otras ciudades es necesario que anuncie el evangelio del reino de Dios; porque para esto soy enviado.
Y predicaba en las sinagogas de Galilea.
Y ACONTECIÓ, que estando él junto al lago de Genezaret, las gentes se agolpaban sobre él para oir la palabra de Dios.
Y vió dos barcos que estaban cerca de la orilla del lago: y los pescadores, habiendo descendido de ellos, lavaban sus redes.
Y entrado en uno de estos barcos, el cual era de Simón, le rogó que lo desviase de tierra un poco; y sentándose, enseñaba desde el barco á las gentes.
Y como cesó de hablar, dijo á Simón: Tira á alta mar, y echad vuestras redes para pescar.
Y respondiendo Simón, le dijo: Maestro, habiendo trabajado toda la noche, nada hemos tomado; mas en tu palabra echaré la red.
Y habiéndolo hecho, encerraron gran multitud de pescado, que su red se rompía.
E hicieron señas á los compañeros que estaban en el otro barco, que viniesen á ayudarles; y vinieron, y llenaron ambos barcos, de tal manera que se anegaban.
Lo cual viendo Simón Pedro, se derribó de rodillas á Jesús, diciendo: Apártate de mí, Señor, porque soy hombre pecador.
Porque temor le había rodeado, y á todos los que estaban con él, de la presa de los peces que habían tomado;
Y asimismo á Jacobo y á Juan, hijos de Zebedeo, que eran compañeros de Simón. Y Jesús dijo á Simón: No temas: desde ahora pescarás hombres.
Y como llegaron á tierra los barcos, dejándolo todo, le siguieron.
Y aconteció que estando en una ciudad, he aquí un hombre lleno de lepra, el cual viendo á Jesús, postrándose sobre el rostro, le rogó, diciendo: Señor, si quieres, puedes limpiarme.
Entonces, extendiendo la mano, le tocó diciendo: Quiero: sé limpio. Y luego la lepra se fué de él.
Y él le mandó que no lo dijese á nadie: Mas ve, díjole, muéstrate al sacerdote, y ofrece por tu limpieza, como mandó Moisés, para testimonio á ellos.
Empero tanto más se extendía su fama: y se juntaban muchas gentes á oir y ser sanadas de sus enfermedades.
Mas él se apartaba á los desiertos, y oraba.
Y he aquí unos hombres, que traían sobre un lecho un hombre que estaba paralítico; y buscaban meterle, y ponerle delante de él.
Y no hallando por donde meterle á causa de la multitud, subieron encima de la casa, y por el tejado le bajaron con el lecho en medio, delante de Jesús;
El cual, viendo la fe de ellos, le dice: Hombre, tus pecados te son perdonados.
Entonces los escribas y los Fariseos comenzaron á pensar, diciendo: ¿Quién es éste que habla blasfemias? ¿Quién puede perdonar pecados sino sólo Dios?
Jesús entonces, conociendo los pensamientos de ellos, respondiendo les dijo: ¿Qué pensáis en vuestros corazones?
¿Qué es más fácil, decir: Tus pecados te son perdonados, ó decir: Levántate y anda?
Pues para que sepáis que el Hijo del hombre tiene potestad en la tierra de perdonar pecados, (dice al paralítico): A ti digo, levántate, toma tu lecho, y vete á tu casa.
Y luego, levantándose en presencia de ellos, y tomando aquel en que estaba echado, se fué á su casa, glorificando á Dios.
Y tomó espanto á todos, y glorificaban á Dios; y fueron llenos de temor, diciendo: Hemos visto maravillas hoy.
Y después de estas cosas salió, y vió á un publicano llamado Leví, sentado al banco de los públicos tributos, y le dijo: Sígueme.
Y dejadas todas las cosas, levantándose, le siguió.
E hizo Leví gran banquete en su casa; y había mucha compañía de publicanos y de otros, los cuales estaban á la mesa con ellos.
Y los escribas y los Fariseos murmuraban contra sus discípulos, diciendo: ¿Por qué coméis y bebéis con los publicanos y pecadores?
Y respondiendo Jesús, les dijo: Los que están sanos no necesitan médico, sino los que están enfermos.
No he venido á llamar justos, sino pecadores á arrepentimiento.
Entonces ellos le dijeron: ¿Por qué los discípulos de Juan ayunan muchas veces y hacen oraciones, y asimismo los de los Fariseos, y tus discípulos comen y beben?
Y él les dijo: ¿Podéis hacer que los que están de bodas ayunen, entre tanto que el esposo está con ellos?
Empero vendrán días cuando el esposo les será quitado: entonces ayunarán en aquellos días.
Y les decía también una parábola: Nadie mete remiendo de paño nuevo en vestido viejo; de otra manera el nuevo rompe, y al viejo no conviene remiendo nuevo.
Y nadie echa vino nuevo en cueros viejos; de otra manera el vino nuevo romperá los cueros, y el vino se derramará, y los cueros se perderán.
Mas el vino nuevo en cueros nuevos se ha de echar; y lo uno y lo otro se conserva.
Y ninguno que bebiere del añejo, quiere luego el nuevo; porque dice: El añejo es mejor.
Y ACONTECIÓ que pasando él por los sembrados en un sábado segundo del primero, sus discípulos arrancaban espigas, y comían, restregándolas con las manos.
Y algunos de los Fariseos les dijeron: ¿Por qué hacéis lo que no es lícito hacer en los sábados?
Y respondiendo Jesús les dijo: ¿Ni aun esto habéis leído, qué hizo David cuando tuvo hambre, él, y los que con él estaban;
Cómo entró en la casa de Dios, y tomó los panes de la proposición, y comió, y dió también á los que estaban con él, los cuales no era lícito comer, sino á solos los sacerdotes?
Y les decía: El Hijo del hombre es Señor aun del sábado.
Y aconteció también en otro sábado, que él entró en la sinagoga y enseñaba; y estaba allí un hombre que tenía la mano derecha seca.
Y le acechaban los escribas y los Fariseos, si sanaría en sábado, por hallar de qué le acusasen.
Mas él sabía los pensamientos de ellos; y dijo al hombre que tenía la mano seca: Levántate, y ponte en medio. Y él levantándose, se puso en pie.
Entonces Jesús les dice: Os preguntaré una cosa: ¿Es lícito en sábados hacer bien, ó hacer mal? ¿salvar la vida, ó quitarla?
Y mirándolos á todos alrededor, dice al hombre: Extiende tu mano. Y él lo hizo así, y su mano fué restaurada.
Y ellos se llenaron de rabia; y hablaban los unos á los otros qué harían á Jesús.
Y aconteció en aquellos días, que fué al monte á orar, y pasó la noche orando á Dios.
Y como fué de día, llamó á sus discípulos, y escogió doce de ellos, á los cuales también llamó apóstoles:
A Simón, al cual también llamó Pedro, y á Andrés su hermano, Jacobo y Juan, Felipe y Bartolomé,
Mateo y Tomás, Jacobo hijo de Alfeo, y Simón el que se llama Celador,
Judas hermano de Jacobo, y Judas Iscariote, que también fué el traidor.
Y los que habían sido atormentados de espíritus inmundos: y estaban curados.
Y toda la gente procuraba tocarle; porque salía de él virtud, y sanaba á todos.
Y alzando él los ojos á sus discípulos, decía: Bienaventurados vosotros los pobres; porque vuestro es el reino de Dios.
Bienaventurados los que ahora tenéis hambre; porque seréis saciados. Bienaventurados los que ahora lloráis, porque reiréis.
Bienaventurados seréis, cuando los hombres os aborrecieren, y cuando os apartaren de sí, y os denostaren, y desecharen vuestro nombre como malo, por el Hijo del hombre.
Gozaos en aquel día, y alegraos; porque he aquí vuestro galardón es grande en los cielos; porque así hacían sus padres á los profetas.
Mas ¡ay de vosotros, ricos! porque tenéis vuestro consuelo.
¡Ay de vosotros, los que estáis hartos! porque tendréis hambre. ¡Ay de vosotros, los que ahora reís! porque lamentaréis y lloraréis.
¡Ay de vosotros, cuando todos los hombres dijeren bien de vosotros! porque así hacían sus padres á los falsos profetas.
Mas á vosotros los que oís, digo: Amad á vuestros enemigos, haced bien á los que os aborrecen;
Bendecid á los que os maldicen, y orad por los que os calumnian.
Y al que te hiriere en la mejilla, dale también la otra; y al que te quitare la capa, ni aun el sayo le defiendas.
Y á cualquiera que te pidiere, da; y al que tomare lo que es tuyo, no vuelvas á pedir.
Y como queréis que os hagan los hombres, así hacedles también vosotros:
Porque si amáis á los que os aman, ¿qué gracias tendréis? porque también los pecadores aman á los que los aman.
Y si hiciereis bien á los que os hacen bien, ¿qué gracias tendréis? porque también los pecadores hacen lo mismo.
Y si prestareis á aquellos de quienes esperáis recibir, ¿qué gracias tendréis? porque también los pecadores prestan á los pecadores, para recibir otro tanto.
Amad, pues, á vuestros enemigos, y haced bien, y prestad, no esperando de ello nada; y será vuestro galardón grande, y seréis hijos del Altísimo: porque él es benigno para con los ingratos y malos.
Sed pues misericordiosos, como también vuestro Padre es misericordioso.
No juzguéis, y no seréis juzgados: no condenéis, y no seréis condenados: perdonad, y seréis perdonados.
Dad, y se os dará; medida buena, apretada, remecida, y rebosando darán en vuestro seno: porque con la misma medida que midiereis, os será vuelto á medir.
Y les decía una parábola: ¿Puede el ciego guiar al ciego? ¿No caerán ambos en el hoyo?
El discípulo no es sobre su maestro; mas cualquiera que fuere como el maestro, será perfecto.
¿Por qué miras la paja que está en el ojo de tu hermano, y la viga que está en tu propio ojo no consideras?
Porque no es buen árbol el que da malos frutos; ni árbol malo el que da buen fruto.
Porque cada árbol por su fruto es conocido: que no cogen higos de los espinos, ni vendimian uvas de las zarzas.
¿Por qué me llamáis, Señor, Señor, y no hacéis lo que digo?
Todo aquel que viene á mí, y oye mis palabras, y las hace, os enseñaré á quién es semejante:
Mas el que oyó y no hizo, semejante es al hombre que edificó su casa sobre tierra, sin fundamento; en la cual el río dió con ímpetu, y luego cayó; y fué grande la ruina de aquella casa.
Y COMO acabó todas sus palabras oyéndole el pueblo, entró en Capernaum.
Y el siervo de un centurión, al cual tenía él en estima, estaba enfermo y á punto de morir.
Y como oyóhablarde Jesús, envió á él los ancianos de los Judíos, rogándole que viniese y librase á su siervo.
Y viniendo ellos á Jesús, rogáronle con diligencia, diciéndole: Porque es digno de concederle esto;
Que ama nuestra nación, y él nos edificó una sinagoga.
Y Jesús fué con ellos. Mas como ya no estuviesen lejos de su casa, envió el centurión amigos á él, diciéndole: Señor, no te incomodes, que no soy digno que entres debajo de mi tejado;
Por lo cual ni aun me tuve por digno de venir á ti; mas di la palabra, y mi siervo será sano.
Porque también yo soy hombre puesto en potestad, que tengo debajo de mí soldados; y digo á éste: Ve, y va; y al otro: Ven, y viene; y á mi siervo: Haz esto, y lo hace.
Lo cual oyendo Jesús, se maravilló de él, y vuelto, dijo á las gentes que le seguían: Os digoqueni aun en Israel he hallado tanta fe.
Y vueltos á casa los que habían sido enviados, hallaron sano al siervo que había estado enfermo.
Y aconteció después, que él iba á la ciudad que se llama Naín, é iban con él muchos de sus discípulos, y gran compañía.
Y como llegó cerca de la puerta de la ciudad, he aquí que sacaban fuera á un difunto, unigénito de su madre, la cual también era viuda: y había con ella grande compañía de la ciudad.
Y como el Señor la vió, compadecióse de ella, y le dice: No llores.
Y acercándose, tocó el féretro: y los que lo llevaban, pararon. Y dice: Mancebo, á ti digo, levántate.
Entonces se incorporó el que había muerto, y comenzó á hablar. Y dióle á su madre.
Y todos tuvieron miedo, y glorificaban á Dios, diciendo: Que un gran profeta se ha levantado entre nosotros; y que Dios ha visitado á su pueblo.
Y salió esta fama de él por toda Judea, y por toda la tierra de alrededor.
Y sus discípulos dieron á Juan las nuevas de todas estas cosas: y llamó Juan á dos de sus discípulos,
Y envió á Jesús, diciendo: ¿Eres tú aquél que había de venir, ó esperaremos á otro?
Y como los hombres vinieron á él, dijeron: Juan el Bautista nos ha enviado á ti, diciendo: ¿Eres tú aquél que había de venir, ó esperaremos á otro?
Y en la misma hora sanó á muchos de enfermedades y plagas, y de espíritus malos; y á muchos ciegos dió la vista.
Y bienaventurado es el que no fuere escandalizado en mí.
Y como se fueron los mensajeros de Juan, comenzó á hablar de Juan á las gentes: ¿Qué salisteis á ver al desierto? ¿una caña que es agitada por el viento?
Mas ¿qué salisteis á ver? ¿un hombre cubierto de vestidos delicados? He aquí, los que están en vestido precioso, y viven en delicias, en los palacios de los reyes están.
Mas ¿qué salisteis á ver? ¿un profeta? También os digo, y aun más que profeta.
Este es de quien está escrito: He aquí, envío mi mensajero delante de tu faz, el cual aparejará tu camino delante de ti.
Porque os digo que entre los nacidos de mujeres, no hay mayor profeta que Juan el Bautista: mas el más pequeño en el reino de los cielos es mayor que él.
Y todo el pueblo oyéndole, y los publicanos, justificaron á Dios, bautizándose con el bautismo de Juan.
Mas los Fariseos y los sabios de la ley, desecharon el consejo de Dios contra sí mismos, no siendo bautizados de él.
Y dice el Señor: ¿A quién, pues, compararé los hombres de esta generación, y á qué son semejantes?
Semejantes son á los muchachos sentados en la plaza, y que dan voces los unos á los otros, y dicen: Os tañimos con flautas, y no bailasteis: os endechamos, y no llorasteis.
Porque vino Juan el Bautista, que ni comía pan, ni bebía vino, y decís: Demonio tiene.
Vino el Hijo del hombre, que come y bebe, y decís: He aquí un hombre comilón, y bebedor de vino, amigo de publicanos y de pecadores.
Mas la sabiduría es justificada de todos sus hijos.
Y le rogó uno de los Fariseos, que comiese con él. Y entrado en casa del Fariseo, sentóse á la mesa.
Y he aquí una mujer que había sido pecadora en la ciudad, como entendió que estaba á la mesa en casa de aquel Fariseo, trajo un alabastro de ungüento,
Y estando detrás á sus pies, comenzó llorando á regar con lágrimas sus pies, y los limpiaba con los cabellos de su cabeza; y besaba sus pies, y los ungía con el ungüento.
Y como vió esto el Fariseo que le había convidado, habló entre sí, diciendo: Este, si fuera profeta, conocería quién y cuál es la mujer que le toca, que es pecadora.
Entonces respondiendo Jesús, le dijo: Simón, una cosa tengo que decirte. Y él dice: Di, Maestro.
Un acreedor tenía dos deudores: el uno le debía quinientos denarios, y el otro cincuenta;
Y no teniendo ellos de qué pagar, perdonó á ambos. Di, pues, ¿cuál de éstos le amará más?
Y respondiendo Simón, dijo: Pienso que aquél al cual perdonó más. Y él le dijo: Rectamente has juzgado.
No me diste beso, mas ésta, desde que entré, no ha cesado de besar mis pies.
No ungiste mi cabeza con óleo; mas ésta ha ungido con ungüento mis pies.
Por lo cual te digo que sus muchos pecados son perdonados, porque amó mucho; mas al que se perdona poco, poco ama.
Y á ella dijo: Los pecados te son perdonados.
Y los que estaban juntamente sentados á la mesa, comenzaron á decir entre sí: ¿Quién es éste, que también perdona pecados?
Y dijo á la mujer: Tu fe te ha salvado, ve en paz.
Y ACONTECIÓ después, que él caminaba por todas las ciudades y aldeas, predicando y anunciando el evangelio del reino de Dios, y los doce con él,
Y algunas mujeres que habían sido curadas de malos espíritus y de enfermedades: María, que se llamaba Magdalena, de la cual habían salido siete demonios,
Y Juana, mujer de Chuza, procurador de Herodes, y Susana, y otras muchas que le servían de sus haciendas.
Y como se juntó una grande compañía, y los que estaban en cada ciudad vinieron á él, dijo por una parábola:
Uno que sembraba, salió á sembrar su simiente; y sembrando, una parte cayó junto al camino, y fué hollada; y las aves del cielo la comieron.
Y otra parte cayó sobre la piedra; y nacida, se secó, porque no tenía humedad.
Y otra parte cayó entre las espinas; y naciendo las espinas juntamente, la ahogaron.
Y otra parte cayó en buena tierra, y cuando fué nacida, llevó fruto á ciento por uno. Diciendo estas cosas clamaba: El que tiene oídos para oir, oiga.
Y sus discípulos le preguntaron, diciendo, qué era esta parábola.
Y él dijo: A vosotros es dado conocer los misterios del reino de Dios; mas á los otros por parábolas, para que viendo no vean, y oyendo no entiendan.
Es pues ésta la parábola: La simiente es la palabra de Dios.
Y los de junto al camino, éstos son los que oyen; y luego viene el diablo, y quita la palabra de su corazón, porque no crean y se salven.
Y los de sobre la piedra, son los que habiendo oído, reciben la palabra con gozo; mas éstos no tienen raíces; que á tiempo creen, y en el tiempo de la tentación se apartan.
Y la que cayó entre las espinas, éstos son los que oyeron; mas yéndose, son ahogados de los cuidados y de las riquezas y de los pasatiempos de la vida, y no llevan fruto.
Mas la que en buena tierra, éstos son los que con corazón bueno y recto retienen la palabra oída, y llevan fruto en paciencia.
Ninguno que enciende la antorcha la cubre con vasija, ó la pone debajo de la cama; mas la pone en un candelero, para que los que entran vean la luz.
Porque no hay cosa oculta, que no haya de ser manifestada; ni cosa escondida, que no haya de ser entendida, y de venir á luz.
Mirad pues cómo oís; porque á cualquiera que tuviere, le será dado; y á cualquiera que no tuviere, aun lo que parece tener le será quitado.
Y vinieron á él su madre y hermanos; y no podían llegar á él por causa de la multitud.
Y le fué dado aviso, diciendo: Tu madre y tus hermanos están fuera, que quieren verte.
El entonces respondiendo, les dijo: Mi madre y mis hermanos son los que oyen la palabra de Dios, y la ejecutan.
Y aconteció un día que él entró en un barco con sus discípulos, y les dijo: Pasemos á la otra parte del lago. Y partieron.
Pero mientras ellos navegaban, él se durmió. Y sobrevino una tempestad de viento en el lago; y henchían de agua, y peligraban.
Y llegándose á él, le despertaron, diciendo: ¡Maestro, Maestro, que perecemos! Y despertado él, increpó al viento y á la tempestad del agua; y cesaron, y fué hecha bonanza.
Y les dijo: ¿Qué es de vuestra fe? Y atemorizados, se maravillaban, diciendo los unos á los otros: ¿Quién es éste, que aun á los vientos y al agua manda, y le obedecen?
Y navegaron á la tierra de los Gadarenos, que está delante de Galilea.
Y saliendo él á tierra, le vino al encuentro de la ciudad un hombre que tenía demonios ya de mucho tiempo; y no vestía vestido, ni estaba en casa, sino por los sepulcros.
El cual, como vió á Jesús, exclamó y se postró delante de él, y dijo á gran voz: ¿Qué tengo yo contigo, Jesús, Hijo del Dios Altísimo? Ruégote que no me atormentes.
Y le preguntó Jesús, diciendo: ¿Qué nombre tienes? Y él dijo: Legión. Porque muchos demonios habían entrado en él.
Y le rogaban que no les mandase ir al abismo.
Y había allí un hato de muchos puercos que pacían en el monte; y le rogaron que los dejase entrar en ellos; y los dejó.
Y salidos los demonios del hombre, entraron en los puercos; y el hato se arrojó de un despeñadero en el lago, y ahogóse.
Y los pastores, como vieron lo que había acontecido, huyeron, y yendo dieron aviso en la ciudad y por las heredades.
Y salieron á ver lo que había acontecido; y vinieron á Jesús, y hallaron sentado al hombre de quien habían salido los demonios, vestido, y en su juicio, á los pies de Jesús; y tuvieron miedo.
Y les contaron los que lo habían visto, cómo había sido salvado aquel endemoniado.
Entonces toda la multitud de la tierra de los Gadarenos alrededor, le rogaron que se fuese de ellos; porque tenían gran temor. Y él, subiendo en el barco, volvióse.
Y aquel hombre, de quien habían salido los demonios, le rogó para estar con él; mas Jesús le despidió, diciendo:
Vuélvete á tu casa, y cuenta cuán grandes cosas ha hecho Dios contigo. Y él se fué, publicando por toda la ciudad cuán grandes cosas había hecho Jesús con él.
Y aconteció que volviendo Jesús, recibióle la gente; porque todos le esperaban.
Y he aquí un varón, llamado Jairo, y que era príncipe de la sinagoga, vino, y cayendo á los pies de Jesús, le rogaba que entrase en su casa;
Porque tenía una hija única, como de doce años, y ella se estaba muriendo. Y yendo, le apretaba la compañía.
Y una mujer, que tenía flujo de sangre hacía ya doce años, la cual había gastado en médicos toda su hacienda, y por ninguno había podido ser curada,
Llegándose por las espaldas, tocó el borde de su vestido; y luego se estancó el flujo de su sangre.
Entonces Jesús dijo: ¿Quién es el que me ha tocado? Y negando todos, dijo Pedro y los que estaban con él: Maestro, la compañía te aprieta y oprime, y dices: ¿Quién es el que me ha tocado?
Y Jesús dijo: Me ha tocado alguien; porque yo he conocido que ha salido virtud de mí.
Y él le dijo: Hija, tu fe te ha salvado: ve en paz.
Estando aún él hablando, vino uno del príncipe de la sinagoga á decirle: Tu hija es muerta, no des trabajo al Maestro.
Y oyéndolo Jesús, le respondió: No temas: cree solamente, y será salva.
Y entrado en casa, no dejó entrar á nadie consigo, sino á Pedro, y á Jacobo, y á Juan, y al padre y á la madre de la moza.
Y lloraban todos, y la plañían. Y él dijo: No lloréis; no es muerta, sino que duerme.
Y hacían burla de él, sabiendo que estaba muerta.
Mas él, tomándola de la mano, clamó, diciendo: Muchacha, levántate.
Entonces su espíritu volvió, y se levantó luego: y él mandó que le diesen de comer.
Y sus padres estaban atónitos; á los cuales él mandó, que á nadie dijesen lo que había sido hecho.
Y JUNTANDO á sus doce discípulos, les dió virtud y potestad sobre todos los demonios, y que sanasen enfermedades.
Y los envió á que predicasen el reino de Dios, y que sanasen á los enfermos.
Y les dice: No toméis nada para el camino, ni báculo, ni alforja, ni pan, ni dinero; ni tengáis dos vestidos cada uno.
Y en cualquiera casa en que entrareis, quedad allí, y de allí salid.
Y todos los que no os recibieren, saliéndoos de aquella ciudad, aun el polvo sacudid de vuestros pies en testimonio contra ellos.
Y saliendo, rodeaban por todas las aldeas, anunciando el evangelio, y sanando por todas partes.
Y oyó Herodes el tetrarca todas las cosas que hacía; y estaba en duda, porque decían algunos: Juan ha resucitado de los muertos;
Y otros: Elías ha aparecido; y otros: Algún profeta de los antiguos ha resucitado.
Y dijo Herodes: A Juan yo degollé: ¿quién pues será éste, de quien yo oigo tales cosas? Y procuraba verle.
Y vueltos los apóstoles, le contaron todas las cosas que habían hecho. Y tomándolos, se retiró aparte á un lugar desierto de la ciudad que se llama Bethsaida.
Y como lo entendieron las gentes, le siguieron; y él las recibió, y les hablaba del reino de Dios, y sanaba á los que tenían necesidad de cura.
Y les dice: Dadles vosotros de comer. Y dijeron ellos: No tenemos más que cinco panes y dos pescados, si no vamos nosotros á comprar viandas para toda esta compañía.
Y eran como cinco mil hombres. Entonces dijo á sus discípulos: Hacedlos sentar en ranchos, de cincuenta en cincuenta.
Y así lo hicieron, haciéndolos sentar á todos.
Y tomando los cinco panes y los dos pescados, mirando al cielo los bendijo, y partió, y dió á sus discípulos para que pusiesen delante de las gentes.
Y comieron todos, y se hartaron; y alzaron lo que les sobró, doce cestos de pedazos.
Y aconteció que estando él solo orando, estaban con él los discípulos; y les preguntó diciendo: ¿Quién dicen las gentes que soy?
Y ellos respondieron, y dijeron: Juan el Bautista; y otros, Elías; y otros, que algún profeta de los antiguos ha resucitado.
Y les dijo: ¿Y vosotros, quién decís que soy? Entonces respondiendo Simón Pedro, dijo: El Cristo de Dios.
Mas él, conminándolos, mandó que á nadie dijesen esto;
Y decía á todos: Si alguno quiere venir en pos de mí, niéguese á sí mismo, y tome su cruz cada día, y sígame.
Porque cualquiera que quisiere salvar su vida, la perderá; y cualquiera que perdiere su vida por causa de mí, éste la salvará.
Porque ¿qué aprovecha al hombre, si granjeare todo el mundo, y se pierda él á sí mismo, ó corra peligro de sí?
Porque el que se avergonzare de mí y de mis palabras, de este tal el Hijo del hombre se avergonzará cuando viniere en su gloria, y del Padre, y de los santos ángeles.
Y os digo en verdad, que hay algunos de los que están aquí, que no gustarán la muerte, hasta que vean el reino de Dios.
Y aconteció como ocho días después de estas palabras, que tomó á Pedro y á Juan y á Jacobo, y subió al monte á orar.
Y entre tanto que oraba, la apariencia de su rostro se hizo otra, y su vestido blanco y resplandeciente.
Y he aquí dos varones que hablaban con él, los cuales eran Moisés y Elías;
Que aparecieron en majestad, y hablaban de su salida, la cual había de cumplir en Jerusalem.
Y Pedro y los que estaban con él, estaban cargados de sueño: y como despertaron, vieron su majestad, y á aquellos dos varones que estaban con él.
Y estando él hablando esto, vino una nube que los cubrió; y tuvieron temor, entrando ellos en la nube.
Y vino una voz de la nube, que decía: Este es mi Hijo amado; á él oid.
Y pasada aquella voz, Jesús fué hallado solo: y ellos callaron; y por aquellos días no dijeron nada á nadie de lo que habían visto.
Y aconteció al día siguiente, que apartándose ellos del monte, gran compañía les salió al encuentro.
Y he aquí, un hombre de la compañía clamó, diciendo: Maestro, ruégote que veas á mi hijo; que es el único que tengo:
Y he aquí un espíritu le toma, y de repente da voces; y le despedaza y hace echar espuma, y apenas se aparta de él quebrantándole.
Y rogué á tus discípulos que le echasen fuera, y no pudieron.
Y respondiendo Jesús, dice: ¡Oh generación infiel y perversa! ¿hasta cuándo tengo de estar con vosotros, y os sufriré? Trae tu hijo acá.
Y como aun se acercaba, el demonio le derribó y despedazó: mas Jesús increpó al espíritu inmundo, y sanó al muchacho, y se lo volvió á su padre.
Y todos estaban atónitos de la grandeza de Dios. Y maravillándose todos de todas las cosas que hacía, dijo á sus discípulos:
Poned vosotros en vuestros oídos estas palabras; porque ha de acontecer que el Hijo del hombre será entregado en manos de hombres.
Mas ellos no entendían esta palabra, y les era encubierta para que no la entendiesen; y temían preguntarle de esta palabra.
Entonces entraron en disputa, cuál de ellos sería el mayor.
Mas Jesús, viendo los pensamientos del corazón de ellos, tomó un niño, y púsole junto á sí,
Entonces respondiendo Juan, dijo: Maestro, hemos visto á uno que echaba fuera demonios en tu nombre; y se lo prohibimos, porque no sigue con nosotros.
Jesús le dijo: No se lo prohibáis; porque el que no es contra nosotros, por nosotros es.
Y aconteció que, como se cumplió el tiempo en que había de ser recibido arriba, él afirmó su rostro para ir á Jerusalem.
Y envió mensajeros delante de sí, los cuales fueron y entraron en una ciudad de los Samaritanos, para prevenirle.
Mas no le recibieron, porque era su traza de ir á Jerusalem.
Y viendo esto sus discípulos Jacobo y Juan, dijeron: Señor, ¿quieres que mandemos que descienda fuego del cielo, y los consuma, como hizo Elías?
Entonces volviéndose él, los reprendió, diciendo: Vosotros no sabéis de qué espíritu sois;
Porque el Hijo del hombre no ha venido para perder las almas de los hombres, sino para salvarlas. Y se fueron á otra aldea.
Y aconteció que yendo ellos, uno le dijo en el camino: Señor, te seguiré donde quiera que fueres.
Y le dijo Jesús: Las zorras tienen cuevas, y las aves de los cielos nidos; mas el Hijo del hombre no tiene donde recline la cabeza.
Y dijo á otro: Sígueme. Y él dijo: Señor, déjame que primero vaya y entierre á mi padre.
Y Jesús le dijo: Deja los muertos que entierren á sus muertos; y tú, ve, y anuncia el reino de Dios.
Entonces también dijo otro: Te seguiré, Señor; mas déjame que me despida primero de los que están en mi casa.
Y Jesús le dijo: Ninguno que poniendo su mano al arado mira atrás, es apto para el reino de Dios.
Y DESPUÉS de estas cosas, designó el Señor aun otros setenta, los cuales envió de dos en dos delante de sí, á toda ciudad y lugar á donde él había de venir.
Y les decía: La mies á la verdad es mucha, mas los obreros pocos; por tanto, rogad al Señor de la mies que envíe obreros á su mies.
Andad, he aquí yo os envío como corderos en medio de lobos.
No llevéis bolsa, ni alforja, ni calzado; y á nadie saludéis en el camino.
En cualquiera casa donde entrareis, primeramente decid: Paz sea á esta casa.
Y si hubiere allí algún hijo de paz, vuestra paz reposará sobre él; y si no, se volverá á vosotros.
Y posad en aquella misma casa, comiendo y bebiendo lo que os dieren; porque el obrero digno es de su salario. No os paséis de casa en casa.
Y en cualquier ciudad donde entrareis, y os recibieren, comed lo que os pusieren delante;
Y sanad los enfermos que en ella hubiere, y decidles: Se ha llegado á vosotros el reino de Dios.
Mas en cualquier ciudad donde entrareis, y no os recibieren, saliendo por sus calles, decid:
Aun el polvo que se nos ha pegado de vuestra ciudad á nuestros pies, sacudimos en vosotros: esto empero sabed, que el reino de los cielos se ha llegado á vosotros.
Y os digo que los de Sodoma tendrán más remisión aquel día, que aquella ciudad.
Por tanto, Tiro y Sidón tendrán más remisión que vosotras en el juicio.
Y tú, Capernaum, que hasta los cielos estás levantada, hasta los infiernos serás abajada.
El que á vosotros oye, á mí oye; y el que á vosotros desecha, á mí desecha; y el que á mí desecha, desecha al que me envió.
Y volvieron los setenta con gozo, diciendo: Señor, aun los demonios se nos sujetan en tu nombre.
Y les dijo: Yo veía á Satanás, como un rayo, que caía del cielo.
He aquí os doy potestad de hollar sobre las serpientes y sobre los escorpiones, y sobre toda fuerza del enemigo, y nada os dañará.
Mas no os gocéis de esto, que los espíritus se os sujetan; antes gozaos de que vuestros nombres están escritos en los cielos.
Y vuelto particularmente á los discípulos, dijo: Bienaventurados los ojos que ven lo que vosotros veis:
Porque os digo que muchos profetas y reyes desearon ver lo que vosotros veis, y no lo vieron; y oir lo que oís, y no lo oyeron.
Y he aquí, un doctor de la ley se levantó, tentándole y diciendo: Maestro, ¿haciendo qué cosa poseeré la vida eterna?
Y él le dijo: ¿Qué está escrito en la ley? ¿cómo lees?
Y él respondiendo, dijo: Amarás al Señor tu Dios de todo tu corazón, y de toda tu alma, y de todas tus fuerzas, y de todo tu entendimiento; y á tu prójimo como á ti mismo.
Y díjole: Bien has respondido: haz esto, y vivirás.
Mas él, queriéndose justificar á sí mismo, dijo á Jesús: ¿Y quién es mi prójimo?
Y respondiendo Jesús, dijo: Un hombre descendía de Jerusalem á Jericó, y cayó en manos de ladrones, los cuales le despojaron; é hiriéndole, se fueron, dejándole medio muerto.
Y aconteció, que descendió un sacerdote por aquel camino, y viéndole, se pasó de un lado.
Y asimismo un Levita, llegando cerca de aquel lugar, y viéndole, se pasó de un lado.
Mas un Samaritano que transitaba, viniendo cerca de él, y viéndole, fué movido á misericordia;
Y llegándose, vendó sus heridas, echándoles aceite y vino; y poniéndole sobre su cabalgadura, llevóle al mesón, y cuidó de él.
Y otro día al partir, sacó dos denarios, y diólos al huésped, y le dijo: Cuídamele; y todo lo que de más gastares, yo cuando vuelva te lo pagaré.
¿Quién, pues, de estos tres te parece que fué el prójimo de aquél que cayó en manos de los ladrones?
Y él dijo: El que usó con él de misericordia. Entonces Jesús le dijo: Ve, y haz tú lo mismo.
Y aconteció que yendo, entró él en una aldea: y una mujer llamada Marta, le recibió en su casa.
Y ésta tenía una hermana que se llamaba María, la cual sentándose á los pies de Jesús, oía su palabra.
Empero Marta se distraía en muchos servicios; y sobreviniendo, dice: Señor, ¿no tienes cuidado que mi hermana me deja servir sola? Dile pues, que me ayude.
Pero respondiendo Jesús, le dijo: Marta, Marta, cuidadosa estás, y con las muchas cosas estás turbada:
Empero una cosa es necesaria; y María escogió la buena parte, la cual no le será quitada.
Y ACONTECIÓ que estando él orando en un lugar, como acabó, uno de sus discípulos le dijo: Señor, enséñanos á orar, como también Juan enseñó á sus discípulos.
Y les dijo: Cuando orareis, decid: Padre nuestro que estás en los cielos; sea tu nombre santificado. Venga tu reino. Sea hecha tu voluntad, como en el cielo, así también en la tierra.
El pan nuestro de cada día, dánoslohoy.
Y perdónanos nuestros pecados, porque también nosotros perdonamos á todos los que nos deben. Y no nos metas en tentación, mas líbranos del malo.
Díjoles también: ¿Quién de vosotros tendrá un amigo, é irá á él á media noche, y le dirá: Amigo, préstame tres panes,
Porque un amigo mío ha venido á mí de camino, y no tengo qué ponerle delante;
Y el de dentro respondiendo, dijere: No me seas molesto; la puerta está ya cerrada, y mis niños están conmigo en cama; no puedo levantarme, y darte?
Os digo, que aunque no se levante á darle por ser su amigo, cierto por su importunidad se levantará, y le dará todo lo que habrá menester.
Y yo os digo: Pedid, y se os dará; buscad, y hallaréis; llamad, y os será abierto.
Porque todo aquel que pide, recibe; y el que busca, halla; y al que llama, se abre.
¿Y cuál padre de vosotros, si su hijo le pidiere pan, le dará una piedra? ó, si pescado, ¿en lugar de pescado, le dará una serpiente?
O, si le pidiere un huevo, ¿le dará un escorpión?
Pues si vosotros, siendo malos, sabéis dar buenas dádivas á vuestros hijos, ¿cuánto más vuestro Padre celestial dará el Espíritu Santo á los que lo pidieren de él?
Y estaba él lanzando un demonio, el cual era mudo: y aconteció que salido fuera el demonio, el mudo habló, y las gentes se maravillaron.
Mas algunos de ellos decían: En Beelzebub, príncipe de los demonios, echa fuera los demonios.
Y otros, tentando, pedían de él señal del cielo.
Mas él, conociendo los pensamientos de ellos, les dijo: Todo reino dividido contra sí mismo, es asolado; y una casa dividida contra sí misma, cae.
Y si también Satanás está dividido contra sí mismo, ¿cómo estará en pie su reino? porque decís que en Beelzebub echo yo fuera los demonios.
Pues si yo echo fuera los demonios en Beelzebub, ¿vuestros hijos en quién los echan fuera? Por tanto, ellos serán vuestros jueces.
Mas si por el dedo de Dios echo yo fuera los demonios, cierto el reino de Dios ha llegado á vosotros.
Cuando el fuerte armado guarda su atrio, en paz está lo que posee.
Mas si sobreviniendo otro más fuerte que él, le venciere, le toma todas sus armas en que confiaba, y reparte sus despojos.
El que no es conmigo, contra mí es; y el que conmigo no recoge, desparrama.
Cuando el espíritu inmundo saliere del hombre, anda por lugares secos, buscando reposo; y no hallándolo, dice: Me volveré á mi casa de donde salí.
Y viniendo, la halla barrida y adornada.
Entonces va, y toma otros siete espíritus peores que él; y entrados, habitan allí: y lo postrero del tal hombre es peor que lo primero.
Y aconteció que diciendo estas cosas, una mujer de la compañía, levantando la voz, le dijo: Bienaventurado el vientre que te trajo, y los pechos que mamaste.
Y él dijo: Antes bienaventurados los que oyen la palabra de Dios, y la guardan.
Y juntándose las gentes á él, comenzó á decir: Esta generación mala es: señal busca, mas señal no le será dada, sino la señal de Jonás.
Porque como Jonás fué señal á los Ninivitas, así también será el Hijo del hombre á esta generación.
Los hombres de Nínive se levantarán en juicio con esta generación, y la condenarán; porque á la predicación de Jonás se arrepintieron; y he aquí más que Jonás en este lugar.
Nadie pone en oculto la antorcha encendida, ni debajo del almud, sino en el candelero, para que los que entran vean la luz.
La antorcha del cuerpo es el ojo: pues si tu ojo fuere simple, también todo tu cuerpo será resplandeciente; mas si fuere malo, también tu cuerpo será tenebroso.
Mira pues, si la lumbre que en ti hay, es tinieblas.
Así que, siendo todo tu cuerpo resplandeciente, no teniendo alguna parte de tinieblas, será todo luminoso, como cuando una antorcha de resplandor te alumbra.
Y luego que hubo hablado, rogóle un Fariseo que comiese con él: y entrado Jesús, se sentó á la mesa.
Y el Fariseo, como lo vió, maravillóse de que no se lavó antes de comer.
Y el Señor le dijo: Ahora vosotros los Fariseos lo de fuera del vaso y del plato limpiáis; mas lo interior de vosotros está lleno de rapiña y de maldad.
Necios, ¿el que hizo lo de fuera, no hizo también lo de dentro?
Empero de lo que os resta, dad limosna; y he aquí todo os será limpio.
Mas ¡ay de vosotros, Fariseos! que diezmáis la menta, y la ruda, y toda hortaliza; mas el juicio y la caridad de Dios pasáis de largo. Pues estas cosas era necesario hacer, y no dejar las otras.
¡Ay de vosotros, Fariseos! que amáis las primeras sillas en las sinagogas, y las salutaciones en las plazas.
¡Ay de vosotros, escribas y Fariseos, hipócritas! que sois como sepulcros que no se ven, y los hombres que andan encima no lo saben.
Y respondiendo uno de los doctores de la ley, le dice: Maestro, cuando dices esto, también nos afrentas á nosotros.
Y él dijo: ¡Ay de vosotros también, doctores de la ley! que cargáis á los hombres con cargas que no pueden llevar; mas vosotros ni aun con un dedo tocáis las cargas.
¡Ay de vosotros! que edificáis los sepulcros de los profetas, y los mataron vuestros padres.
De cierto dais testimonio que consentís en los hechos de vuestros padres; porque á la verdad ellos los mataron, mas vosotros edificáis sus sepulcros.
Por tanto, la sabiduría de Dios también dijo: Enviaré á ellos profetas y apóstoles; y de ellos á unos matarán y á otros perseguirán;
Para que de esta generación sea demandada la sangre de todos los profetas, que ha sido derramada desde la fundación del mundo;
Desde la sangre de Abel, hasta la sangre de Zacarías, que murió entre el altar y el templo: así os digo, será demandada de esta generación.
¡Ay de vosotros, doctores de la ley! que habéis quitado la llave de la ciencia; vosotros mismos no entrasteis, y á los que entraban impedisteis.
Y diciéndoles estas cosas, los escribas y los Fariseos comenzaron á apretarle en gran manera, y á provocarle á que hablase de muchas cosas;
Acechándole, y procurando cazar algo de su boca para acusarle.
Porque nada hay encubierto, que no haya de ser descubierto; ni oculto, que no haya de ser sabido.
Por tanto, las cosas que dijisteis en tinieblas, á la luz serán oídas; y lo que hablasteis al oído en las cámaras, será pregonado en los terrados.
Mas os digo, amigos míos: No temáis de los que matan el cuerpo, y después no tienen más que hacer.
Mas os enseñaré á quién temáis: temed á aquel que después de haber quitado la vida, tiene poder de echar en la Gehenna: así os digo: á éste temed.
¿No se venden cinco pajarillos por dos blancas? pues ni uno de ellos está olvidado delante de Dios.
Y aun los cabellos de vuestra cabeza están todos contados. No temáis pues: de más estima sois que muchos pajarillos.
Y os digo que todo aquel que me confesare delante de los hombres, también el Hijo del hombre le confesará delante de los ángeles de Dios;
Mas el que me negare delante de los hombres, será negado delante de los ángeles de Dios.
Y todo aquel que dice palabra contra el Hijo del hombre, le será perdonado; mas al que blasfemare contra el Espíritu Santo, no le será perdonado.
Y cuando os trajeren á las sinagogas, y á los magistrados y potestades, no estéis solícitos cómo ó qué hayáis de responder, ó qué hayáis de decir;
Porque el Espíritu Santo os enseñará en la misma hora lo que será necesario decir.
Y díjole uno de la compañía: Maestro, di á mi hermano que parta conmigo la herencia.
Mas él le dijo: Hombre, ¿quién me puso por juez ó partidor sobre vosotros?
Y díjoles: Mirad, y guardaos de toda avaricia; porque la vida del hombre no consiste en la abundancia de los bienes que posee.
Y refirióles una parábola, diciendo: La heredad de un hombre rico había llevado mucho;
Y él pensaba dentro de sí, diciendo: ¿Qué haré, porque no tengo donde juntar mis frutos?
Y dijo: Esto haré: derribaré mis alfolíes, y los edificaré mayores, y allí juntaré todos mis frutos y mis bienes;
Y diré á mi alma: Alma, muchos bienes tienes almacenados para muchos años; repósate, come, bebe, huélgate.
Y díjole Dios: Necio, esta noche vuelven á pedir tu alma; y lo que has prevenido, ¿de quién será?
Así es el que hace para sí tesoro, y no es rico en Dios.
Y dijo á sus discípulos: Por tanto os digo: No estéis afanosos de vuestra vida, qué comeréis; ni del cuerpo, qué vestiréis.
La vida más es que la comida, y el cuerpo que el vestido.
Considerad los cuervos, que ni siembran, ni siegan; que ni tienen cillero, ni alfolí; y Dios los alimenta. ¿Cuánto de más estima sois vosotros que las aves?
¿Y quién de vosotros podrá con afán añadir á su estatura un codo?
Pues si no podéis aun lo que es menos, ¿para qué estaréis afanosos de lo demás?
Considerad los lirios, cómo crecen: no labran, ni hilan; y os digo, que ni Salomón con toda su gloria se vistió como uno de ellos.
Y si así viste Dios á la hierba, que hoy está en el campo, y mañana es echada en el horno; ¿cuánto más á vosotros, hombres de poca fe?
Vosotros, pues, no procuréis qué hayáis de comer, ó qué hayáis de beber; ni estéis en ansiosa perplejidad.
Porque todas estas cosas buscan las gentes del mundo; que vuestro Padre sabe que necesitáis estas cosas.
Mas procurad el reino de Dios, y todas estas cosas os serán añadidas.
No temáis, manada pequeña; porque al Padre ha placido daros el reino.
Vended lo que poseéis, y dad limosna; haceos bolsas que no se envejecen, tesoro en los cielos que nunca falta; donde ladrón no llega, ni polilla corrompe.
Porque donde está vuestro tesoro, allí también estará vuestro corazón.
Estén ceñidos vuestros lomos, y vuestras antorchas encendidas;
Y vosotros semejantes á hombres que esperan cuando su señor ha de volver de las bodas; para que cuando viniere y llamare, luego le abran.
Bienaventurados aquellos siervos, á los cuales cuando el Señor viniere, hallare velando: de cierto os digo, que se ceñirá, y hará que se sienten á la mesa, y pasando les servirá.
Y aunque venga á la segunda vigilia, y aunque venga á la tercera vigilia, y los hallare así, bienaventurados son los tales siervos.
Esto empero sabed, que si supiese el padre de familia á qué hora había de venir el ladrón, velaría ciertamente, y no dejaría minar su casa.
Vosotros pues también, estad apercibidos; porque á la hora que no pensáis, el Hijo del hombre vendrá.
Entonces Pedro le dijo: Señor, ¿dices esta parábola á nosotros, ó también á todos?
Y dijo el Señor: ¿Quién es el mayordomo fiel y prudente, al cual el señor pondrá sobre su familia, para que á tiempo les dé su ración?
Bienaventurado aquel siervo, al cual, cuando el señor viniere, hallare haciendo así.
En verdad os digo, que él le pondrá sobre todos sus bienes.
Mas si el tal siervo dijere en su corazón: Mi señor tarda en venir: y comenzare á herir á los siervos y á las criadas, y á comer y á beber y á embriagarse;
Vendrá el señor de aquel siervo el día que no espera, y á la hora que no sabe, y le apartará, y pondrá su parte con los infieles.
Porque el siervo que entendió la voluntad de su señor, y no se apercibió, ni hizo conforme á su voluntad, será azotado mucho.
Fuego vine á meter en la tierra: ¿y qué quiero, si ya está encendido?
Empero de bautismo me es necesario ser bautizado: y ¡cómo me angustio hasta que sea cumplido!
¿Pensáis que he venido á la tierra á dar paz? No, os digo; mas disensión.
Porque estarán de aquí adelante cinco en una casa divididos; tres contra dos, y dos contra tres.
Y decía también á las gentes: Cuando veis la nube que sale del poniente, luego decís: Agua viene; y es así.
Y cuando sopla el austro, decís: Habrá calor; y lo hay.
¡Hipócritas! Sabéis examinar la faz del cielo y de la tierra; ¿y cómo no reconocéis este tiempo?
¿Y por qué aun de vosotros mismos no juzgáis lo que es justo?
Te digo que no saldrás de allá, hasta que hayas pagado hasta el último maravedí.
Y EN este mismo tiempo estaban allí unos que le contaban acerca de los Galileos, cuya sangre Pilato había mezclado con sus sacrificios.
Y respondiendo Jesús, les dijo: ¿Pensáis que estos Galileos, porque han padecido tales cosas, hayan sido más pecadores que todos los Galileos?
No, os digo; antes si no os arrepintiereis, todos pereceréis igualmente.
O aquellos dieciocho, sobre los cuales cayó la torre en Siloé, y los mató, ¿pensáis que ellos fueron más deudores que todos los hombres que habitan en Jerusalem?
No, os digo; antes si no os arrepintiereis, todos pereceréis asimismo.
Y dijo esta parábola: Tenía uno una higuera plantada en su viña, y vino á buscar fruto en ella, y no lo halló.
Y dijo al viñero: He aquí tres años ha que vengo á buscar fruto en esta higuera, y no lo hallo; córtala, ¿por qué ocupará aún la tierra?
El entonces respondiendo, le dijo: Señor, déjala aún este año, hasta que la excave, y estercole.
Y si hiciere fruto, bien; y si no, la cortarás después.
Y enseñaba en una sinagoga en sábado.
Y he aquí una mujer que tenía espíritu de enfermedad dieciocho años, y andaba agobiada, que en ninguna manera se podía enhestar.
Y como Jesús la vió, llamóla, y díjole: Mujer, libre eres de tu enfermedad.
Y puso las manos sobre ella; y luego se enderezó, y glorificaba á Dios.
Entonces el Señor le respondió, y dijo: Hipócrita, cada uno de vosotros ¿no desata en sábado su buey ó su asno del pesebre, y lo lleva á beber?
Y á esta hija de Abraham, que he aquí Satanás la había ligado dieciocho años, ¿no convino desatarla de esta ligadura en día de sábado?
Y diciendo estas cosas, se avergonzaban todos sus adversarios: mas todo el pueblo se gozaba de todas las cosas gloriosas que eran por él hechas.
Y dijo: ¿A qué es semejante el reino de Dios, y á qué le compararé?
Semejante es al grano de la mostaza, que tomándolo un hombre lo metió en su huerto; y creció, y fué hecho árbol grande, y las aves del cielo hicieron nidos en sus ramas.
Y otra vez dijo: ¿A qué compararé el reino de Dios?
Semejante es á la levadura, que tomó una mujer, y la escondió en tres medidas de harina, hasta que todo hubo fermentado.
Y pasaba por todas las ciudades y aldeas, enseñando, y caminando á Jerusalem.
Y díjole uno: Señor, ¿son pocos los que se salvan? Y él les dijo:
Porfiad á entrar por la puerta angosta; porque os digo que muchos procurarán entrar, y no podrán.
Entonces comenzaréis á decir: Delante de ti hemos comido y bebido, y en nuestras plazas enseñaste;
Y os dirá: Dígoos que no os conozco de dónde seáis; apartaos de mí todos los obreros de iniquidad.
Allí será el llanto y el crujir de dientes, cuando viereis á Abraham, y á Isaac, y á Jacob, y á todos los profetas en el reino de Dios, y vosotros excluídos.
Y vendrán del Oriente y del Occidente, del Norte y del Mediodía, y se sentarán á la mesa en el reino de Dios.
Y he aquí, son postreros los que eran los primeros; y son primeros los que eran los postreros.
Aquel mismo día llegaron unos de los Fariseos, diciéndole: Sal, y vete de aquí, porque Herodes te quiere matar.
Y les dijo: Id, y decid á aquella zorra: He aquí, echo fuera demonios y acabo sanidades hoy y mañana, y al tercer día soy consumado.
Empero es menester que hoy, y mañana, y pasado mañana camine; porque no es posible que profeta muera fuera de Jerusalem.
He aquí, os es dejada vuestra casa desierta: y os digo que no me veréis, hasta que venga tiempo cuando digáis: Bendito el que viene en nombre del Señor.
Y ACONTECIÓ que entrando en casa de un príncipe de los Fariseos un sábado á comer pan, ellos le acechaban.
Y he aquí un hombre hidrópico estaba delante de él.
Y respondiendo Jesús, habló á los doctores de la ley y á los Fariseos, diciendo: ¿Es lícito sanar en sábado?
Y ellos callaron. Entonces él tomándole, le sanó, y despidióle.
Y respondiendo á ellos dijo: ¿El asno ó el buey de cuál de vosotros caerá en algún pozo, y no lo sacará luego en día de sábado?
Y no le podían replicar á estas cosas.
Y observando cómo escogían los primeros asientos á la mesa, propuso una parábola á los convidados, diciéndoles:
Cuando fueres convidado de alguno á bodas, no te sientes en el primer lugar, no sea que otro más honrado que tú esté por él convidado,
Y viniendo el que te llamó á ti y á él, te diga: Da lugar á éste: y entonces comiences con vergüenza á tener el lugar último.
Porque cualquiera que se ensalza, será humillado; y el que se humilla, será ensalzado.
Mas cuando haces banquete, llama á los pobres, los mancos, los cojos, los ciegos;
Y serás bienaventurado; porque no te pueden retribuir; mas te será recompensado en la resurrección de los justos.
Y oyendo esto uno de los que juntamente estaban sentados á la mesa, le dijo: Bienaventurado el que comerá pan en el reino de los cielos.
El entonces le dijo: Un hombre hizo una grande cena, y convidó á muchos.
Y á la hora de la cena envió á su siervo á decir á los convidados: Venid, que ya está todo aparejado.
Y comenzaron todos á una á excusarse. El primero le dijo: He comprado una hacienda, y necesito salir y verla; te ruego que me des por excusado.
Y el otro dijo: He comprado cinco yuntas de bueyes, y voy á probarlos; ruégote que me des por excusado.
Y el otro dijo: Acabo de casarme, y por tanto no puedo ir.
Y dijo el siervo: Señor, hecho es como mandaste, y aun hay lugar.
Y dijo el señor al siervo: Ve por los caminos y por los vallados, y fuérzalos á entrar, para que se llene mi casa.
Porque os digo que ninguno de aquellos hombres que fueron llamados, gustará mi cena.
Y muchas gentes iban con él; y volviéndose les dijo:
Si alguno viene á mí, y no aborrece á su padre, y madre, y mujer, é hijos, y hermanos, y hermanas, y aun también su vida, no puede ser mi discípulo.
Y cualquiera que no trae su cruz, y viene en pos de mí, no puede ser mi discípulo.
Porque ¿cuál de vosotros, queriendo edificar una torre, no cuenta primero sentado los gastos, si tiene lo que necesita para acabarla?
Porque después que haya puesto el fundamento, y no pueda acabarla, todos los que lo vieren, no comiencen á hacer burla de él,
Diciendo: Este hombre comenzó á edificar, y no pudo acabar.
¿O cuál rey, habiendo de ir á hacer guerra contra otro rey, sentándose primero no consulta si puede salir al encuentro con diez mil al que viene contra él con veinte mil?
De otra manera, cuando aun el otro está lejos, le ruega por la paz, enviándole embajada.
Así pues, cualquiera de vosotros que no renuncia á todas las cosas que posee, no puede ser mi discípulo.
Buena es la sal; mas si aun la sal fuere desvanecida, ¿con qué se adobará?
Ni para la tierra, ni para el muladar es buena; fuera la arrojan. Quien tiene oídos para oir, oiga.
Y SE llegaban á él todos los publicanos y pecadores á oirle.
Y murmuraban los Fariseos y los escribas, diciendo: Este á los pecadores recibe, y con ellos come.
Y él les propuso esta parábola, diciendo:
¿Qué hombre de vosotros, teniendo cien ovejas, si perdiere una de ellas, no deja las noventa y nueve en el desierto, y va á la que se perdió, hasta que la halle?
Y hallada, la pone sobre sus hombros gozoso;
Y viniendo á casa, junta á los amigos y á los vecinos, diciéndoles: Dadme el parabién, porque he hallado mi oveja que se había perdido.
Os digo, que así habrá más gozo en el cielo de un pecador que se arrepiente, que de noventa y nueve justos, que no necesitan arrepentimiento.
¿O qué mujer que tiene diez dracmas, si perdiere una dracma, no enciende el candil, y barre la casa, y busca con diligencia hasta hallarla?
Y cuando la hubiere hallado, junta las amigas y las vecinas, diciendo: Dadme el parabién, porque he hallado la dracma que había perdido.
Así os digo que hay gozo delante de los ángeles de Dios por un pecador que se arrepiente.
Y dijo: Un hombre tenía dos hijos;
Y el menor de ellos dijo á su padre: Padre, dame la parte de la hacienda que me pertenece: y les repartió la hacienda.
Y no muchos días después, juntándolo todo el hijo menor, partió lejos á una provincia apartada; y allí desperdició su hacienda viviendo perdidamente.
Y cuando todo lo hubo malgastado, vino una grande hambre en aquella provincia, y comenzóle á faltar.
Y fué y se llegó á uno de los ciudadanos de aquella tierra, el cual le envió á su hacienda para que apacentase los puercos.
Y deseaba henchir su vientre de las algarrobas que comían los puercos; mas nadie se las daba.
Y volviendo en sí, dijo: ¡Cuántos jornaleros en casa de mi padre tienen abundancia de pan, y yo aquí perezco de hambre!
Me levantaré, é iré á mi padre, y le diré: Padre, he pecado contra el cielo, y contra ti;
Ya no soy digno de ser llamado tu hijo; hazme como á uno de tus jornaleros.
Y levantándose, vino á su padre. Y como aun estuviese lejos, viólo su padre, y fué movido á misericordia, y corrió, y echóse sobre su cuello, y besóle.
Y el hijo le dijo: Padre, he pecado contra el cielo, y contra ti, y ya no soy digno de ser llamado tu hijo.
Mas el padre dijo á sus siervos: Sacad el principal vestido, y vestidle; y poned un anillo en su mano, y zapatos en sus pies.
Y traed el becerro grueso, y matadlo, y comamos, y hagamos fiesta:
Porque este mi hijo muerto era, y ha revivido; habíase perdido, y es hallado. Y comenzaron á regocijarse.
Y su hijo el mayor estaba en el campo; el cual como vino, y llegó cerca de casa, oyó la sinfonía y las danzas;
Y llamando á uno de los criados, preguntóle qué era aquello.
Y él le dijo: Tu hermano ha venido; y tu padre ha muerto el becerro grueso, por haberle recibido salvo.
Entonces se enojó, y no quería entrar. Salió por tanto su padre, y le rogaba que entrase.
Mas él respondiendo, dijo al padre: He aquí tantos años te sirvo, no habiendo traspasado jamás tu mandamiento, y nunca me has dado un cabrito para gozarme con mis amigos:
Mas cuando vino éste tu hijo, que ha consumido tu hacienda con rameras, has matado para él el becerro grueso.
El entonces le dijo: Hijo, tú siempre estás conmigo, y todas mis cosas son tuyas.
Mas era menester hacer fiesta y holgarnos, porque este tu hermano muerto era, y ha revivido; habíase perdido, y es hallado.
Y DIJO también á sus discípulos: Había un hombre rico, el cual tenía un mayordomo, y éste fué acusado delante de él como disipador de sus bienes.
Y le llamó, y le dijo: ¿Qué es esto que oigo de ti? Da cuenta de tu mayordomía, porque ya no podrás más ser mayordomo.
Entonces el mayordomo dijo dentro de sí: ¿Qué haré? que mi señor me quita la mayordomía. Cavar, no puedo; mendigar, tengo vergüenza.
Yo sé lo que haré para que cuando fuere quitado de la mayordomía, me reciban en sus casas.
Y llamando á cada uno de los deudores de su señor, dijo al primero: ¿Cuánto debes á mi señor?
Y él dijo: Cien barriles de aceite. Y le dijo: Toma tu obligación, y siéntate presto, y escribe cincuenta.
Después dijo á otro: ¿Y tú, cuánto debes? Y él dijo: Cien coros de trigo. Y él le dijo: Toma tu obligación, y escribe ochenta.
Y alabó el señor al mayordomo malo por haber hecho discretamente; porque los hijos de este siglo son en su generación más sagaces que los hijos de luz.
Y yo os digo: Haceos amigos de las riquezas de maldad, para que cuando faltareis, os reciban en las moradas eternas.
El que es fiel en lo muy poco, también en lo más es fiel: y el que en lo muy poco es injusto, también en lo más es injusto.
Pues si en las malas riquezas no fuisteis fieles, ¿quién os confiará lo verdadero?
Y si en lo ajeno no fuisteis fieles, ¿quién os dará lo que es vuestro?
Ningún siervo puede servir á dos señores; porque ó aborrecerá al uno y amará al otro, ó se allegará al uno y menospreciará al otro. No podéis servir á Dios y á las riquezas.
Y oían también todas estas cosas los Fariseos, los cuales eran avaros, y se burlaban de él.
La ley y los profetas hasta Juan: desde entonces el reino de Dios es anunciado, y quienquiera se esfuerza á entrar en él.
Empero más fácil cosa es pasar el cielo y la tierra, que frustrarse un tilde de la ley.
Cualquiera que repudia á su mujer, y se casa con otra, adultera: y el que se casa con la repudiada del marido, adultera.
Había un hombre rico, que se vestía de púrpura y de lino fino, y hacía cada día banquete con esplendidez.
Había también un mendigo llamado Lázaro, el cual estaba echado á la puerta de él, lleno de llagas,
Y deseando hartarse de las migajas que caían de la mesa del rico; y aun los perros venían y le lamían las llagas.
Y aconteció que murió el mendigo, y fué llevado por los ángeles al seno de Abraham: y murió también el rico, y fué sepultado.
Y en el infierno alzó sus ojos, estando en los tormentos, y vió á Abraham de lejos, y á Lázaro en su seno.
Entonces él, dando voces, dijo: Padre Abraham, ten misericordia de mí, y envía á Lázaro que moje la punta de su dedo en agua, y refresque mi lengua; porque soy atormentado en esta llama.
Y díjole Abraham: Hijo, acuérdate que recibiste tus bienes en tu vida, y Lázaro también males; mas ahora éste es consolado aquí, y tú atormentado.
Y además de todo esto, una grande sima está constituída entre nosotros y vosotros, que los que quisieren pasar de aquí á vosotros, no pueden, ni de allá pasar acá.
Y dijo: Ruégote pues, padre, que le envíes á la casa de mi padre;
Porque tengo cinco hermanos; para que les testifique, porque no vengan ellos también á este lugar de tormento.
Y Abraham le dice: A Moisés y á los profetas tienen: óiganlos.
El entonces dijo: No, padre Abraham: mas si alguno fuere á ellos de los muertos, se arrepentirán.
Mas Abraham le dijo: Si no oyen á Moisés y á los profetas, tampoco se persuadirán, si alguno se levantare de los muertos.
Y Á SUS discípulos dice: Imposible es que no vengan escándalos; mas ¡ay de aquél por quien vienen!
Mejor le fuera, si le pusiesen al cuello una piedra de molino, y le lanzasen en el mar, que escandalizar á uno de estos pequeñitos.
Mirad por vosotros: si pecare contra ti tu hermano, repréndele; y si se arrepintiere, perdónale.
Y si siete veces al día pecare contra ti, y siete veces al día se volviere á ti, diciendo, pésame, perdónale.
Y dijeron los apóstoles al Señor: Auméntanos la fe.
Entonces el Señor dijo: Si tuvieseis fe como un grano de mostaza, diréis á este sicómoro: Desarráigate, y plántate en el mar; y os obedecerá.
¿Y quién de vosotros tiene un siervo que ara ó apacienta, que vuelto del campo le diga luego: Pasa, siéntate á la mesa?
¿No le dice antes: Adereza qué cene, y arremángate, y sírveme hasta que haya comido y bebido; y después de esto, come tú y bebe?
¿Da gracias al siervo porque hizo lo que le había sido mandado? Pienso que no.
Así también vosotros, cuando hubiereis hecho todo lo que os es mandado, decid: Siervos inútiles somos, porque lo que debíamos hacer, hicimos.
Y aconteció que yendo él á Jerusalem, pasaba por medio de Samaria y de Galilea.
Y entrando en una aldea, viniéronle al encuentro diez hombres leprosos, los cuales se pararon de lejos,
Y alzaron la voz, diciendo: Jesús, Maestro, ten misericordia de nosotros.
Y como él los vió, les dijo: Id, mostraos á los sacerdotes. Y aconteció, que yendo ellos, fueron limpios.
Entonces uno de ellos, como se vió que estaba limpio, volvió, glorificando á Dios á gran voz;
Y derribóse sobre el rostro á sus pies, dándole gracias: y éste era Samaritano.
Y respondiendo Jesús, dijo: ¿No son diez los que fueron limpios? ¿Y los nueve dónde están?
¿No hubo quien volviese y diese gloria á Dios sino este extranjero?
Y díjole: Levántate, vete; tu fe te ha salvado.
Y preguntado por los Fariseos, cuándo había de venir el reino de Dios, les respondió y dijo: El reino de Dios no vendrá con advertencia;
Ni dirán: Helo aquí, ó helo allí: porque he aquí el reino de Dios entre vosotros está.
Y dijo á sus discípulos: Tiempo vendrá, cuando desearéis ver uno de los días del Hijo del hombre, y no lo veréis.
Y os dirán: Helo aquí, ó helo allí. No vayáis, ni sigáis.
Porque como el relámpago, relampagueando desde una parte de debajo del cielo, resplandece hasta la otra debajo del cielo, así también será el Hijo del hombre en su día.
Mas primero es necesario que padezca mucho, y sea reprobado de esta generación.
Y como fué en los días de Noé, así también será en los días del Hijo del hombre.
Comían, bebían, los hombres tomaban mujeres, y las mujeres maridos, hasta el día que entró Noé en el arca; y vino el diluvio, y destruyó á todos.
Asimismo también como fué en los días de Lot; comían, bebían, compraban, vendían, plantaban, edificaban;
Mas el día que Lot salió de Sodoma, llovió del cielo fuego y azufre, y destruyó á todos:
Como esto será el día en que el Hijo del hombre se manifestará.
En aquel día, el que estuviere en el terrado, y sus alhajas en casa, no descienda á tomarlas: y el que en el campo, asimismo no vuelva atrás.
Acordaos de la mujer de Lot.
Cualquiera que procurare salvar su vida, la perderá; y cualquiera que la perdiere, la salvará.
Os digo que en aquella noche estarán dos en una cama; el uno será tomado, y el otro será dejado.
Dos mujeres estarán moliendo juntas: la una será tomada, y la otra dejada.
Y respondiendo, le dicen: ¿Dónde, Señor? Y él les dijo: Donde estuviere el cuerpo, allá se juntarán también las águilas.
Y PROPÚSOLES también una parábola sobre que es necesario orar siempre, y no desmayar,
Diciendo: Había un juez en una ciudad, el cual ni temía á Dios, ni respetaba á hombre.
Había también en aquella ciudad una viuda, la cual venía á él diciendo: Hazme justicia de mi adversario.
Pero él no quiso por algún tiempo; mas después de esto dijo dentro de sí: Aunque ni temo á Dios, ni tengo respeto á hombre,
Todavía, porque esta viuda me es molesta, le haré justicia, porque al fin no venga y me muela.
Y dijo el Señor: Oid lo que dice el juez injusto.
¿Y Dios no hará justicia á sus escogidos, que claman á él día y noche, aunque sea longánime acerca de ellos?
Os digo que los defenderá presto. Empero cuando el Hijo del hombre viniere, ¿hallará fe en la tierra?
Y dijo también á unos que confiaban de sí como justos, y menospreciaban á los otros, esta parábola:
Dos hombres subieron al templo á orar: el uno Fariseo, el otro publicano.
El Fariseo, en pie, oraba consigo de esta manera: Dios, te doy gracias, que no soy como los otros hombres, ladrones, injustos, adúlteros, ni aun como este publicano;
Ayuno dos veces á la semana, doy diezmos de todo lo que poseo.
Mas el publicano estando lejos no quería ni aun alzar los ojos al cielo, sino que hería su pecho, diciendo: Dios, sé propicio á mí pecador.
Os digo que éste descendió á su casa justificado antes que el otro; porque cualquiera que se ensalza, será humillado; y el que se humilla, será ensalzado.
Y traían á él los niños para que los tocase; lo cual viendo los discípulos les reñían.
Mas Jesús llamándolos, dijo: Dejad los niños venir á mí, y no los impidáis; porque de tales es el reino de Dios.
De cierto os digo, que cualquiera que no recibiere el reino de Dios como un niño, no entrará en él.
Y preguntóle un príncipe, diciendo: Maestro bueno, ¿qué haré para poseer la vida eterna?
Y Jesús le dijo: ¿Por qué me llamas bueno? ninguno hay bueno sino sólo Dios.
Los mandamientos sabes: No matarás: No adulterarás: No hurtarás: No dirás falso testimonio: Honra á tu padre y á tu madre.
Y él dijo: Todas estas cosas he guardado desde mi juventud.
Y Jesús, oído esto, le dijo: Aun te falta una cosa: vende todo lo que tienes, y da á los pobres, y tendrás tesoro en el cielo; y ven, sígueme.
Entonces él, oídas estas cosas, se puso muy triste, porque era muy rico.
Y viendo Jesús que se había entristecido mucho, dijo: ¡Cuán dificultosamente entrarán en el reino de Dios los que tienen riquezas!
Porque más fácil cosa es entrar un camello por el ojo de una aguja, que un rico entrar en el reino de Dios.
Y los que lo oían, dijeron: ¿Y quién podrá ser salvo?
Y él les dijo: Lo que es imposible para con los hombres, posible es para Dios.
Entonces Pedro dijo: He aquí, nosotros hemos dejado las posesiones nuestras, y te hemos seguido.
Y él les dijo: De cierto os digo, que nadie hay que haya dejado casa, padres, ó hermanos, ó mujer, ó hijos, por el reino de Dios,
Que no haya de recibir mucho más en este tiempo, y en el siglo venidero la vida eterna.
Y Jesús, tomando á los doce, les dijo: He aquí subimos á Jerusalem, y serán cumplidas todas las cosas que fueron escritas por los profetas, del Hijo del hombre.
Porque será entregado á las gentes, y será escarnecido, é injuriado, y escupido.
Y después que le hubieren azotado, le matarán: mas al tercer día resucitará.
Pero ellos nada de estas cosas entendían, y esta palabra les era encubierta, y no entendían lo que se decía.
Y aconteció que acercándose él á Jericó, un ciego estaba sentado junto al camino mendigando;
El cual como oyó la gente que pasaba, preguntó qué era aquello.
Y dijéronle que pasaba Jesús Nazareno.
Entonces dió voces, diciendo: Jesús, Hijo de David, ten misericordia de mí.
Y los que iban delante, le reñían que callase; mas él clamaba mucho más: Hijo de David, ten misericordia de mí.
Jesús entonces parándose, mandó traerle á sí: y como él llegó, le preguntó,
Diciendo: ¿Qué quieres que te haga? Y él dijo: Señor, que vea.
Y Jesús le dijo: Ve, tu fe te ha hecho salvo.
Y luego vió, y le seguía, glorificando á Dios: y todo el pueblo como lo vió, dió á Dios alabanza.
Y HABIENDO entradoJesús, iba pasando por Jericó;
Y he aquí un varón llamado Zaqueo, el cual era el principal de los publicanos, y era rico;
Y procuraba ver á Jesús quién fuese; mas no podía á causa de la multitud, porque era pequeño de estatura.
Y corriendo delante, subióse á un árbol sicómoro para verle; porque había de pasar por allí.
Y como vino á aquel lugar Jesús, mirando, le vió, y díjole: Zaqueo, date priesa, desciende, porque hoy es necesario que pose en tu casa.
Entonces él descendió apriesa, y le recibió gozoso.
Y viendo esto, todos murmuraban, diciendo que había entrado á posar con un hombre pecador.
Entonces Zaqueo, puesto en pie, dijo al Señor: He aquí, Señor, la mitad de mis bienes doy á los pobres; y si en algo he defraudado á alguno, lo vuelvo con el cuatro tanto.
Y Jesús le dijo: Hoy ha venido la salvación á esta casa; por cuanto él también es hijo de Abraham.
Porque el Hijo del hombre vino á buscar y á salvar lo que se había perdido.
Y oyendo ellos estas cosas, prosiguió Jesús y dijo una parábola, por cuanto estaba cerca de Jerusalem, y porque pensaban que luego había de ser manifestado el reino de Dios.
Dijo pues: Un hombre noble partió á una provincia lejos, para tomar para sí un reino, y volver.
Mas llamados diez siervos suyos, les dió diez minas, y díjoles: Negociad entre tanto que vengo.
Empero sus ciudadanos le aborrecían, y enviaron tras de él una embajada, diciendo: No queremos que éste reine sobre nosotros.
Y vino el primero, diciendo: Señor, tu mina ha ganado diez minas.
Y él le dice: Está bien, buen siervo; pues que en lo poco has sido fiel, tendrás potestad sobre diez ciudades.
Y vino otro, diciendo: Señor, tu mina ha hecho cinco minas.
Y también á éste dijo: Tú también sé sobre cinco ciudades.
Y vino otro, diciendo: Señor, he aquí tu mina, la cual he tenido guardada en un pañizuelo:
Porque tuve miedo de ti, que eres hombre recio; tomas lo que no pusiste, y siegas lo que no sembraste.
Entonces él le dijo: Mal siervo, de tu boca te juzgo. Sabías que yo era hombre recio, que tomo lo que no puse, y que siego lo que no sembré;
¿Por qué, pues, no diste mi dinero al banco, y yo viniendo lo demandara con el logro?
Y dijo á los que estaban presentes: Quitadle la mina, y dadla al que tiene las diez minas.
Y ellos le dijeron: Señor, tiene diez minas.
Pues yo os digo que á cualquiera que tuviere, le será dado; mas al que no tuviere, aun lo que tiene le será quitado.
Y también á aquellos mis enemigos que no querían que yo reinase sobre ellos, traedlos acá, y degolladlos delante de mí.
Y dicho esto, iba delante subiendo á Jerusalem.
Y aconteció, que llegando cerca de Bethfagé, y de Bethania, al monte que se llama de las Olivas, envió dos de sus discípulos,
Diciendo: Id á la aldea de enfrente; en la cual como entrareis, hallaréis un pollino atado, en el que ningún hombre se ha sentado jamás; desatadlo, y traedlo.
Y si alguien os preguntare, ¿por qué lo desatáis? le responderéis así: Porque el Señor lo ha menester.
Y fueron los que habían sido enviados, y hallaron como les dijo.
Y desatando ellos el pollino, sus dueños les dijeron: ¿Por qué desatáis el pollino?
Y ellos dijeron: Porque el Señor lo ha menester.
Y trajéronlo á Jesús; y habiendo echado sus vestidos sobre el pollino, pusieron á Jesús encima.
Y yendo él tendían sus capas por el camino.
Y como llegasen ya cerca de la bajada del monte de las Olivas, toda la multitud de los discípulos, gozándose, comenzaron á alabar á Dios á gran voz por todas las maravillas que habían visto,
Diciendo: ¡Bendito el rey que viene en el nombre del Señor: paz en el cielo, y gloria en lo altísimo!
Entonces algunos de los Fariseos de la compañía, le dijeron: Maestro, reprende á tus discípulos.
Y él respondiendo, les dijo: Os digo que si éstos callaren, las piedras clamarán.
Y como llegó cerca, viendo la ciudad, lloró sobre ella,
Diciendo: ¡Oh si también tú conocieses, á lo menos en este tu día, lo que toca á tu paz! mas ahora está encubierto de tus ojos.
Porque vendrán días sobre ti, que tus enemigos te cercarán con baluarte, y te pondrán cerco, y de todas partes te pondrán en estrecho,
Y te derribarán á tierra, y á tus hijos dentro de ti; y no dejarán sobre ti piedra sobre piedra; por cuanto no conociste el tiempo de tu visitación.
Y entrando en el templo, comenzó á echar fuera á todos los que vendían y compraban en él.
Diciéndoles: Escrito está: Mi casa, casa de oración es; mas vosotros la habéis hecho cueva de ladrones.
Y enseñaba cada día en el templo; mas los príncipes de los sacerdotes, y los escribas, y los principales del pueblo procuraban matarle.
Y no hallaban qué hacerle, porque todo el pueblo estaba suspenso oyéndole.
Y ACONTECIÓ un día, que enseñando él al pueblo en el templo, y anunciando el evangelio, llegáronse los príncipes de los sacerdotes y los escribas, con los ancianos;
Y le hablaron, diciendo: Dinos: ¿con qué potestad haces estas cosas? ¿ó quién es el que te ha dado esta potestad?
Respondiendo entonces Jesús, les dijo: Os preguntaré yo también una palabra; respondedme:
El bautismo de Juan, ¿era del cielo, ó de los hombres?
Mas ellos pensaban dentro de sí, diciendo: Si dijéremos, del cielo, dirá: ¿Por qué, pues, no le creísteis?
Y si dijéremos, de los hombres, todo el pueblo nos apedreará: porque están ciertos que Juan era profeta.
Y respondieron que no sabían de dónde.
Entonces Jesús les dijo: Ni yo os digo con qué potestad hago estas cosas.
Y comenzó á decir al pueblo esta parábola: Un hombre plantó una viña, y arrendóla á labradores, y se ausentó por mucho tiempo.
Y al tiempo, envió un siervo á los labradores, para que le diesen del fruto de la viña; mas los labradores le hirieron, y enviaron vacío.
Y volvió á enviar otro siervo; mas ellos á éste también, herido y afrentado, le enviaron vacío.
Y volvió á enviar al tercer siervo; mas ellos también á éste echaron herido.
Entonces el señor de la viña dijo: ¿Qué haré? Enviaré mi hijo amado: quizás cuando á éste vieren, tendrán respeto.
Mas los labradores, viéndole, pensaron entre sí, diciendo: Este es el heredero; venid, matémosle para que la heredad sea nuestra.
Y echáronle fuera de la viña, y le mataron. ¿Qué pues, les hará el señor de la viña?
Vendrá, y destruirá á estos labradores, y dará su viña á otros. Y como ellos lo oyeron, dijeron: ¡Dios nos libre!
Mas él mirándolos, dice: ¿Qué pues es lo que está escrito: La piedra que condenaron los edificadores, ésta fué por cabeza de esquina?
Cualquiera que cayere sobre aquella piedra, será quebrantado; mas sobre el que la piedra cayere, le desmenuzará.
Y procuraban los príncipes de los sacerdotes y los escribas echarle mano en aquella hora, porque entendieron que contra ellos había dicho esta parábola: mas temieron al pueblo.
Y acechándole enviaron espías que se simulasen justos, para sorprenderle en palabras, para que le entregasen al principado y á la potestad del presidente.
Los cuales le preguntaron, diciendo: Maestro, sabemos que dices y enseñas bien, y que no tienes respeto á persona; antes enseñas el camino de Dios con verdad.
¿Nos es lícito dar tributo á César, ó no?
Mas él, entendiendo la astucia de ellos, les dijo: ¿Por qué me tentáis?
Mostradme la moneda. ¿De quién tiene la imagen y la inscripción? Y respondiendo dijeron: De César.
Entonces les dijo: Pues dad á César lo que es de César; y lo que es de Dios, á Dios.
Y no pudieron reprender sus palabras delante del pueblo: antes maravillados de su respuesta, callaron.
Y llegándose unos de los Saduceos, los cuales niegan haber resurrección, le preguntaron,
Diciendo: Maestro, Moisés nos escribió: Si el hermano de alguno muriere teniendo mujer, y muriere sin hijos, que su hermano tome la mujer, y levante simiente á su hermano.
Fueron, pues, siete hermanos: y el primero tomó mujer, y murió sin hijos.
Y la tomó el segundo, el cual también murió sin hijos.
Y la tomó el tercero: asimismo también todos siete: y murieron sin dejar prole.
Y á la postre de todos murió también la mujer.
En la resurrección, pues, ¿mujer de cuál de ellos será? porque los siete la tuvieron por mujer.
Entonces respondiendo Jesús, les dijo: Los hijos de este siglo se casan, y son dados en casamiento:
Mas los que fueren tenidos por dignos de aquel siglo y de la resurrección de los muertos, ni se casan, ni son dados en casamiento:
Porque no pueden ya más morir: porque son iguales á los ángeles, y son hijos de Dios, cuando son hijos de la resurrección.
Y que los muertos hayan de resucitar, aun Moisés lo enseñó en el pasaje de la zarza, cuando llama al Señor: Dios de Abraham, y Dios de Isaac, y Dios de Jacob.
Porque Dios no es Dios de muertos, mas de vivos: porque todos viven á él.
Y respondiéndole unos de los escribas, dijeron: Maestro, bien has dicho.
Y no osaron más preguntarle algo.
Y él les dijo: ¿Cómo dicen que el Cristo es hijo de David?
Y el mismo David dice en el libro de los Salmos: Dijo el Señor á mi Señor: Siéntate á mi diestra,
Entre tanto que pongo tus enemigos por estrado de tus pies.
Así que David le llama Señor: ¿cómo pues es su hijo?
Y oyéndole todo el pueblo, dijo á sus discípulos:
Guardaos de los escribas, que quieren andar con ropas largas, y aman las salutaciones en las plazas, y las primeras sillas en las sinagogas, y los primeros asientos en las cenas;
Que devoran las casas de las viudas, poniendo por pretexto la larga oración: éstos recibirán mayor condenación.
Y MIRANDO, vió á los ricos que echaban sus ofrendas en el gazofilacio.
Y vió también una viuda pobrecilla, que echaba allí dos blancas.
Y dijo: De verdad os digo, que esta pobre viuda echó más que todos:
Porque todos estos, de lo que les sobra echaron para las ofrendas de Dios; mas ésta de su pobreza echó todo el sustento que tenía.
Y á unos que decían del templo, que estaba adornado de hermosas piedras y dones, dijo:
Estas cosas que veis, días vendrán que no quedará piedra sobre piedra que no sea destruída.
Y le preguntaron, diciendo: Maestro, ¿cuándo será esto? ¿y qué señal habrá cuando estas cosas hayan de comenzar á ser hechas?
El entonces dijo: Mirad, no seáis engañados; porque vendrán muchos en mi nombre, diciendo: Yo soy; y, El tiempo está cerca: por tanto, no vayáis en pos de ellos.
Empero cuando oyereis guerras y sediciones, no os espantéis; porque es necesario que estas cosas acontezcan primero: mas no luego será el fin.
Entonces les dijo: Se levantará gente contra gente, y reino contra reino;
Y habrá grandes terremotos, y en varios lugares hambres y pestilencias: y habrá espantos y grandes señales del cielo.
Mas antes de todas estas cosas os echarán mano, y perseguirán, entregándoos á las sinagogas y á las cárceles, siendo llevados á los reyes y á los gobernadores por causa de mi nombre.
Y os será para testimonio.
Poned pues en vuestros corazones no pensar antes cómo habéis de responder:
Porque yo os daré boca y sabiduría, á la cual no podrán resistir ni contradecir todos los que se os opondrán.
Mas seréis entregados aun de vuestros padres, y hermanos, y parientes, y amigos; y matarán á algunos de vosotros.
Y seréis aborrecidos de todos por causa de mi nombre.
Mas un pelo de vuestra cabeza no perecerá.
En vuestra paciencia poseeréis vuestras almas.
Y cuando viereis á Jerusalem cercada de ejércitos, sabed entonces que su destrucción ha llegado.
Entonces los que estuvieren en Judea, huyan á los montes; y los que en medio de ella, váyanse; y los que estén en los campos, no entren en ella.
Porque estos son días de venganza: para que se cumplan todas las cosas que están escritas.
Mas ¡ay de las preñadas, y de las que crían en aquellos días! porque habrá apuro grande sobre la tierra é ira en este pueblo.
Y caerán á filo de espada, y serán llevados cautivos á todas las naciones: y Jerusalem será hollada de las gentes, hasta que los tiempos de las gentes sean cumplidos.
Entonces habrá señales en el sol, y en la luna, y en las estrellas; y en la tierra angustia de gentes por la confusión del sonido de la mar y de las ondas:
Secándose los hombres á causa del temor y expectación de las cosas que sobrevendrán á la redondez de la tierra: porque las virtudes de los cielos serán conmovidas.
Y entonces verán al Hijo del hombre, que vendrá en una nube con potestad y majestad grande.
Y cuando estas cosas comenzaren á hacerse, mirad, y levantad vuestras cabezas, porque vuestra redención está cerca.
Y díjoles una parábola: Mirad la higuera y todos los árboles:
Cuando ya brotan, viéndolo, de vosotros mismos entendéis que el verano está ya cerca.
Así también vosotros, cuando viereis hacerse estas cosas, entended que está cerca el reino de Dios.
De cierto os digo, que no pasará esta generación hasta que todo sea hecho.
El cielo y la tierra pasarán; mas mis palabras no pasarán.
Y mirad por vosotros, que vuestros corazones no sean cargados de glotonería y embriaguez, y de los cuidados de esta vida, y venga de repente sobre vosotros aquel día.
Porque como un lazo vendrá sobre todos los que habitan sobre la faz de toda la tierra.
Velad pues, orando en todo tiempo, que seáis tenidos por dignos de evitar todas estas cosas que han de venir, y de estar en pie delante del Hijo del hombre.
Y enseñaba de día en el templo; y de noche saliendo, estábase en el monte que se llama de las Olivas.
Y todo el pueblo venía á él por la mañana, para oirle en el templo.
Y ESTABA cerca el día de la fiesta de los ázimos, que se llama la Pascua.
Y los príncipes de los sacerdotes y los escribas buscaban cómo le matarían; mas tenían miedo del pueblo.
Y entró Satanás en Judas, por sobrenombre Iscariote, el cual era uno del número de los doce;
Y fué, y habló con los príncipes de los sacerdotes, y con los magistrados, de cómo se lo entregaría.
Los cuales se holgaron, y concertaron de darle dinero.
Y prometió, y buscaba oportunidad para entregarle á ellos sin bulla.
Y vino el día de los ázimos, en el cual era necesario matar la pascua.
Y envió á Pedro y á Juan, diciendo: Id, aparejadnos la pascua para que comamos.
Y ellos le dijeron: ¿Dónde quieres que aparejemos?
Y él les dijo: He aquí cuando entrareis en la ciudad, os encontrará un hombre que lleva un cántaro de agua: seguidle hasta la casa donde entrare,
Y decid al padre de la familia de la casa: El Maestro te dice: ¿Dónde está el aposento donde tengo de comer la pascua con mis discípulos?
Entonces él os mostrará un gran cenáculo aderezado; aparejad allí.
Fueron pues, y hallaron como les había dicho; y aparejaron la pascua.
Y como fué hora, sentóse á la mesa, y con él los apóstoles.
Y les dijo: En gran manera he deseado comer con vosotros esta pascua antes que padezca;
Porque os digo que no comeré más de ella, hasta que se cumpla en el reino de Dios.
Y tomando el vaso, habiendo dado gracias, dijo: Tomad esto, y partidlo entre vosotros;
Porque os digo, que no beberé más del fruto de la vid, hasta que el reino de Dios venga.
Y tomando el pan, habiendo dado gracias, partió, y les dió, diciendo: Esto es mi cuerpo, que por vosotros es dado: haced esto en memoria de mí.
Asimismo también el vaso, después que hubo cenado, diciendo: Este vaso es el nuevo pacto en mi sangre, que por vosotros se derrama.
Con todo eso, he aquí la mano del que me entrega, conmigo en la mesa.
Y á la verdad el Hijo del hombre va, según lo que está determinado; empero ¡ay de aquel hombre por el cual es entregado!
Ellos entonces comenzaron á preguntar entre sí, cuál de ellos sería el que había de hacer esto.
Y hubo entre ellos una contienda, quién de ellos parecía ser el mayor.
Entonces él les dijo: Los reyes de las gentes se enseñorean de ellas; y los que sobre ellas tienen potestad, son llamados bienhechores:
Mas vosotros, no así: antes el que es mayor entre vosotros, sea como el más mozo; y el que es príncipe, como el que sirve.
Porque, ¿cuál es mayor, el que se sienta á la mesa, ó el que sirve? ¿No es el que se sienta á la mesa? Y yo soy entre vosotros como el que sirve.
Empero vosotros sois los que habéis permanecido conmigo en mis tentaciones:
Yo pues os ordeno un reino, como mi Padre me lo ordenó á mí,
Para que comáis y bebáis en mi mesa en mi reino, y os sentéis sobre tronos juzgando á las doce tribus de Israel.
Dijo también el Señor: Simón, Simón, he aquí Satanás os ha pedido para zarandaros como á trigo;
Mas yo he rogado por ti que tu fe no falte: y tú, una vez vuelto, confirma á tus hermanos.
Y él le dijo: Señor, pronto estoy á ir contigo aun á cárcel y á muerte.
Y él dijo: Pedro, te digo que el gallo no cantará hoy antes que tú niegues tres veces que me conoces.
Y á ellos dijo: Cuando os envié sin bolsa, y sin alforja, y sin zapatos, ¿os faltó algo? Y ellos dijeron: Nada.
Y les dijo: Pues ahora, el que tiene bolsa, tómela, y también la alforja, y el que no tiene, venda su capa y compre espada.
Porque os digo, que es necesario que se cumpla todavía en mí aquello que está escrito: Y con los malos fué contado: porque lo que está escrito de mí, cumplimiento tiene.
Entonces ellos dijeron: Señor, he aquí dos espadas. Y él les dijo: Basta.
Y saliendo, se fué, como solía, al monte de las Olivas; y sus discípulos también le siguieron.
Y como llegó á aquel lugar, les dijo: Orad que no entréis en tentación.
Y él se apartó de ellos como un tiro de piedra; y puesto de rodillas oró,
Diciendo: Padre, si quieres, pasa este vaso de mí; empero no se haga mi voluntad, sino la tuya.
Y le apareció un ángel del cielo confortándole.
Y estando en agonía, oraba más intensamente: y fué su sudor como grandes gotas de sangre que caían hasta la tierra.
Y como se levantó de la oración, y vino á sus discípulos, hallólos durmiendo de tristeza;
Y les dijo: ¿Por qué dormís? Levantaos, y orad que no entréis en tentación.
Estando él aún hablando, he aquí una turba; y el que se llamaba Judas, uno de los doce, iba delante de ellos; y llegóse á Jesús para besarlo.
Entonces Jesús le dijo: Judas, ¿con beso entregas al Hijo del hombre?
Y viendo los que estaban con él lo que había de ser, le dijeron: Señor, ¿heriremos á cuchillo?
Y uno de ellos hirió á un siervo del príncipe de los sacerdotes, y le quitó la oreja derecha.
Entonces respondiendo Jesús, dijo: Dejad hasta aquí. Y tocando su oreja, le sanó.
Y Jesús dijo á los que habían venido á él, los príncipes de los sacerdotes, y los magistrados del templo, y los ancianos: ¿Como á ladrón habéis salido con espadas y con palos?
Habiendo estado con vosotros cada día en el templo, no extendisteis las manos contra mí; mas ésta es vuestra hora, y la potestad de las tinieblas.
Y prendiéndole trajéronle, y metiéronle en casa del príncipe de los sacerdotes. Y Pedro le seguía de lejos.
Y habiendo encendido fuego en medio de la sala, y sentándose todos alrededor, se sentó también Pedro entre ellos.
Y como una criada le vió que estaba sentado al fuego, fijóse en él, y dijo: Y éste con él estaba.
Entonces él lo negó, diciendo: Mujer, no le conozco.
Y un poco después, viéndole otro, dijo: Y tú de ellos eras. Y Pedro dijo: Hombre, no soy.
Y como una hora pasada otro afirmaba, diciendo: Verdaderamente también éste estaba con él, porque es Galileo.
Y Pedro dijo: Hombre, no sé qué dices. Y luego, estando él aún hablando, el gallo cantó.
Entonces, vuelto el Señor, miró á Pedro: y Pedro se acordó de la palabra del Señor como le había dicho: Antes que el gallo cante, me negarás tres veces.
Y saliendo fuera Pedro, lloró amargamente.
Y los hombres que tenían á Jesús, se burlaban de él hiriéndole;
Y cubriéndole, herían su rostro, y preguntábanle, diciendo: Profetiza quién es el que te hirió.
Y decían otras muchas cosas injuriándole.
Y cuando fué de día, se juntaron los ancianos del pueblo, y los príncipes de los sacerdotes, y los escribas, y le trajeron á su concilio,
Diciendo: ¿Eres tú el Cristo? dínoslo. Y les dijo: Si os lo dijere, no creeréis;
Y también si os preguntare, no me responderéis, ni me soltaréis:
Mas después de ahora el Hijo del hombre se asentará á la diestra de la potencia de Dios.
Y dijeron todos: ¿Luego tú eres Hijo de Dios? Y él les dijo: Vosotros decís que yo soy.
Entonces ellos dijeron: ¿Qué más testimonio deseamos? porque nosotros lo hemos oído de su boca.
LEVANTÁNDOSE entonces toda la multitud de ellos, lleváronle á Pilato.
Y comenzaron á acusarle, diciendo: A éste hemos hallado que pervierte la nación, y que veda dar tributo á César, diciendo que él es el Cristo, el rey.
Entonces Pilato le preguntó, diciendo: ¿Eres tú el Rey de los Judíos? Y respondiéndole él, dijo: Tú lo dices.
Y Pilato dijo á los príncipes de los sacerdotes, y á las gentes: Ninguna culpa hallo en este hombre.
Mas ellos porfiaban, diciendo: Alborota al pueblo, enseñando por toda Judea, comenzando desde Galilea hasta aquí.
Entonces Pilato, oyendo de Galilea, preguntó si el hombre era Galileo.
Y como entendió que era de la jurisdicción de Herodes, le remitió á Herodes, el cual también estaba en Jerusalem en aquellos días.
Y Herodes, viendo á Jesús, holgóse mucho, porque hacía mucho que deseaba verle; porque había oído de él muchas cosas, y tenía esperanza que le vería hacer alguna señal.
Y le preguntaba con muchas palabras; mas él nada le respondió:
Y estaban los príncipes de los sacerdotes y los escribas acusándole con gran porfía.
Mas Herodes con su corte le menospreció, y escarneció, vistiéndole de una ropa rica; y volvióle á enviar á Pilato.
Y fueron hechos amigos entre sí Pilato y Herodes en el mismo día; porque antes eran enemigos entre sí.
Entonces Pilato, convocando los príncipes de los sacerdotes, y los magistrados, y el pueblo,
Y ni aun Herodes; porque os remití á él, y he aquí, ninguna cosa digna de muerte ha hecho.
Le soltaré, pues, castigado.
Y tenía necesidad de soltarles uno en cada fiesta.
Mas toda la multitud dió voces á una, diciendo: Quita á éste, y suéltanos á Barrabás:
(El cual había sido echado en la cárcel por una sedición hecha en la ciudad, y una muerte.)
Y hablóles otra vez Pilato, queriendo soltar á Jesús.
Pero ellos volvieron á dar voces, diciendo: Crucifícale, crucifícale.
Y él les dijo la tercera vez: ¿Pues qué mal ha hecho éste? Ninguna culpa de muerte he hallado en él: le castigaré, pues, y le soltaré.
Mas ellos instaban á grandes voces, pidiendo que fuese crucificado. Y las voces de ellos y de los príncipes de los sacerdotes crecían.
Entonces Pilato juzgó que se hiciese lo que ellos pedían;
Y les soltó á aquél que había sido echado en la cárcel por sedición y una muerte, al cual habían pedido; y entregó á Jesús á la voluntad de ellos.
Y llevándole, tomaron á un Simón Cireneo, que venía del campo, y le pusieron encima la cruz para que la llevase tras Jesús.
Y le seguía una grande multitud de pueblo, y de mujeres, las cuales le lloraban y lamentaban.
Mas Jesús, vuelto á ellas, les dice: Hijas de Jerusalem, no me lloréis á mí, mas llorad por vosotras mismas, y por vuestros hijos.
Porque he aquí vendrán días en que dirán: Bienaventuradas las estériles, y los vientres que no engendraron, y los pechos que no criaron.
Entonces comenzarán á decir á los montes: Caed sobre nosotros: y á los collados: Cubridnos.
Porque si en el árbol verde hacen estas cosas, ¿en el seco, qué se hará?
Y llevaban también con él otros dos, malhechores, á ser muertos.
Y como vinieron al lugar que se llama de la Calavera, le crucificaron allí, y á los malhechores, uno á la derecha, y otro á la izquierda.
Y Jesús decía: Padre, perdónalos, porque no saben lo que hacen. Y partiendo sus vestidos, echaron suertes.
Y el pueblo estaba mirando; y se burlaban de él los príncipes con ellos, diciendo: A otros hizo salvos: sálvese á sí, si éste es el Mesías, el escogido de Dios.
Escarnecían de él también los soldados, llegándose y presentándole vinagre,
Y diciendo: Si tú eres el Rey de los Judíos, sálvate á ti mismo.
Y había también sobre él un título escrito con letras griegas, y latinas, y hebraicas: ESTE ES EL REY DE LOS JUDIOS.
Y uno de los malhechores que estaban colgados, le injuriaba, diciendo: Si tú eres el Cristo, sálvate á ti mismo y á nosotros.
Y respondiendo el otro, reprendióle, diciendo: ¿Ni aun tú temes á Dios, estando en la misma condenación?
Y nosotros, á la verdad, justamente padecemos; porque recibimos lo que merecieron nuestros hechos: mas éste ningún mal hizo.
Y dijo á Jesús: Acuérdate de mí cuando vinieres á tu reino.
Entonces Jesús le dijo: De cierto te digo, que hoy estarás conmigo en el paraíso.
Y cuando era como la hora de sexta, fueron hechas tinieblas sobre toda la tierra hasta la hora de nona.
Y el sol se obscureció: y el velo del templo se rompió por medio.
Entonces Jesús, clamando á gran voz, dijo: Padre, en tus manos encomiendo mi espíritu. Y habiendo dicho esto, espiró.
Y como el centurión vió lo que había acontecido, dió gloria á Dios, diciendo: Verdaderamente este hombre era justo.
Y toda la multitud de los que estaban presentes á este espectáculo, viendo lo que había acontecido, se volvían hiriendo sus pechos.
Mas todos sus conocidos, y las mujeres que le habían seguido desde Galilea, estaban lejos mirando estas cosas.
Y he aquí un varón llamado José, el cual era senador, varón bueno y justo,
(El cual no había consentido en el consejo ni en los hechos de ellos), de Arimatea, ciudad de la Judea, el cual también esperaba el reino de Dios;
Este llegó á Pilato, y pidió el cuerpo de Jesús.
Y quitado, lo envolvió en una sábana, y le puso en un sepulcro abierto en una peña, en el cual ninguno había aún sido puesto.
Y era día de la víspera de la Pascua; y estaba para rayar el sábado.
Y las mujeres que con él habían venido de Galilea, siguieron también y vieron el sepulcro, y cómo fué puesto su cuerpo.
Y vueltas, aparejaron drogas aromáticas y ungüentos; y reposaron el sábado, conforme al mandamiento.
Y EL primerdíade la semana, muy de mañana, vinieron al sepulcro, trayendo las drogas aromáticas que habían aparejado, y algunas otras mujeres con ellas.
Y hallaron la piedra revuelta del sepulcro.
Y entrando, no hallaron el cuerpo del Señor Jesús.
Y aconteció, que estando ellas espantadas de esto, he aquí se pararon junto á ellas dos varones con vestiduras resplandecientes;
Y como tuviesen ellas temor, y bajasen el rostro á tierra, les dijeron: ¿Por qué buscáis entre los muertos al que vive?
No está aquí, mas ha resucitado: acordaos de lo que os habló, cuando aun estaba en Galilea,
Diciendo: Es menester que el Hijo del hombre sea entregado en manos de hombres pecadores, y que sea crucificado, y resucite al tercer día.
Entonces ellas se acordaron de sus palabras,
Y volviendo del sepulcro, dieron nuevas de todas estas cosas á los once, y á todos los demás.
Y eran María Magdalena, y Juana, y María madre de Jacobo, y las demás con ellas, las que dijeron estas cosas á los apóstoles.
Mas á ellos les parecían como locura las palabras de ellas, y no las creyeron.
Pero levantándose Pedro, corrió al sepulcro: y como miró dentro, vió solos los lienzos echados; y se fué maravillándose de lo que había sucedido.
Y he aquí, dos de ellos iban el mismo día á una aldea que estaba de Jerusalem sesenta estadios, llamada Emmaús.
E iban hablando entre sí de todas aquellas cosas que habían acaecido.
Y aconteció que yendo hablando entre sí, y preguntándose el uno al otro, el mismo Jesús se llegó, é iba con ellos juntamente.
Mas los ojos de ellos estaban embargados, para que no le conociesen.
Y díjoles: ¿Qué pláticas son estas que tratáis entre vosotros andando, y estáis tristes?
Y respondiendo el uno, que se llamaba Cleofas, le dijo: ¿Tú sólo peregrino eres en Jerusalem, y no has sabido las cosas que en ella han acontecido estos días?
Entonces él les dijo: ¿Qué cosas? Y ellos le dijeron: De Jesús Nazareno, el cual fué varón profeta, poderoso en obra y en palabra delante de Dios y de todo el pueblo;
Y cómo le entregaron los príncipes de los sacerdotes y nuestros príncipes á condenación de muerte, y le crucificaron.
Mas nosotros esperábamos que él era el que había de redimir á Israel: y ahora sobre todo esto, hoy es el tercer día que esto ha acontecido.
Aunque también unas mujeres de los nuestros nos han espantado, las cuales antes del día fueron al sepulcro:
Y no hallando su cuerpo, vinieron diciendo que también habían visto visión de ángeles, los cuales dijeron que él vive.
Y fueron algunos de los nuestros al sepulcro, y hallaron así como las mujeres habían dicho; mas á él no le vieron.
Entonces él les dijo: ¡Oh insensatos, y tardos de corazón para creer todo lo que los profetas han dicho!
¿No era necesario que el Cristo padeciera estas cosas, y que entrara en su gloria?
Y comenzando desde Moisés, y de todos los profetas, declarábales en todas las Escrituras lo que de él decían.
Y llegaron á la aldea á donde iban: y él hizo como que iba más lejos.
Mas ellos le detuvieron por fuerza, diciendo: Quédate con nosotros, porque se hace tarde, y el día ya ha declinado. Entró pues á estarse con ellos.
Y aconteció, que estando sentado con ellos á la mesa, tomando el pan, bendijo, y partió, y dióles.
Entonces fueron abiertos los ojos de ellos, y le conocieron; mas él se desapareció de los ojos de ellos.
Y decían el uno al otro: ¿No ardía nuestro corazón en nosotros, mientras nos hablaba en el camino, y cuando nos abría las Escrituras?
Y levantándose en la misma hora, tornáronse á Jerusalem, y hallaron á los once reunidos, y á los que estaban con ellos.
Que decían: Ha resucitado el Señor verdaderamente, y ha aparecido á Simón.
Entonces ellos contaban las cosas que les habían acontecido en el camino, y cómo había sido conocido de ellos al partir el pan.
Y entre tanto que ellos hablaban estas cosas, él se puso en medio de ellos, y les dijo: Paz á vosotros.
Entonces ellos espantados y asombrados, pensaban que veían espíritu.
Mas él les dice: ¿Por qué estáis turbados, y suben pensamientos á vuestros corazones?
Mirad mis manos y mis pies, que yo mismo soy: palpad, y ved; que el espíritu ni tiene carne ni huesos, como veis que yo tengo.
Y en diciendo esto, les mostró las manos y los pies.
Y no creyéndolo aún ellos de gozo, y maravillados, díjoles: ¿Tenéis aquí algo de comer?
Entonces ellos le presentaron parte de un pez asado, y un panal de miel.
Y él tomó, y comió delante de ellos.
Entonces les abrió el sentido, para que entendiesen las Escrituras;
Y díjoles: Así está escrito, y así fué necesario que el Cristo padeciese, y resucitase de los muertos al tercer día;
Y que se predicase en su nombre el arrepentimiento y la remisión de pecados en todas las naciones, comenzando de Jerusalem.
Y vosotros sois testigos de estas cosas.
Y he aquí, yo enviaré la promesa de mi Padre sobre vosotros: mas vosotros asentad en la ciudad de Jerusalem, hasta que seáis investidos de potencia de lo alto.
Y sacólos fuera hasta Bethania, y alzando sus manos, los bendijo.
Y aconteció que bendiciéndolos, se fué de ellos; y era llevado arriba al cielo.
Y ellos, después de haberle adorado, se volvieron á Jerusalem con gran gozo;
Y estaban siempre en el templo, alabando y bendiciendo á Dios. Amén.
EN el principio era el Verbo, y el Verbo era con Dios, y el Verbo era Dios.
Este era en el principio con Dios.
Todas las cosas por él fueron hechas; y sin él nada de lo que es hecho, fué hecho.
En él estaba la vida, y la vida era la luz de los hombres.
Y la luz en las tinieblas resplandece; mas las tinieblas no la comprendieron.
Fué un hombre enviado de Dios, el cual se llamaba Juan.
Este vino por testimonio, para que diese testimonio de la luz, para que todos creyesen por él.
No era él la luz, sino para que diese testimonio de la luz.
Aquélera la luz verdadera, que alumbra á todo hombre que viene á este mundo.
En el mundo estaba, y el mundo fué hecho por él; y el mundo no le conoció.
A lo suyo vino, y los suyos no le recibieron.
Mas á todos los que le recibieron, dióles potestad de ser hechos hijos de Dios, á los que creen en su nombre:
Los cuales no son engendrados de sangre, ni de voluntad de carne, ni de voluntad de varón, mas de Dios.
Y aquel Verbo fué hecho carne, y habitó entre nosotros (y vimos su gloria, gloria como del unigénito del Padre), lleno de gracia y de verdad.
Juan dió testimonio de él, y clamó diciendo: Este es del que yo decía: El que viene tras mí, es antes de mí: porque es primero que yo.
Porque de su plenitud tomamos todos, y gracia por gracia.
Porque la ley por Moisés fué dada: mas la gracia y la verdad por Jesucristo fué hecha.
A Dios nadie le vió jamás: el unigénito Hijo, que está en el seno del Padre, él le declaró.
Y éste es el testimonio de Juan, cuando los Judíos enviaron de Jerusalem sacerdotes y Levitas, que le preguntasen: ¿Tú, quién eres?
Y confesó, y no negó; mas declaró: No soy yo el Cristo.
Y le preguntaron: ¿Qué pues? ¿Eres tú Elías? Dijo: No soy. ¿Eres tú el profeta? Y respondió: No.
Dijéronle: ¿Pues quién eres? para que demos respuesta á los que nos enviaron. ¿Qué dices de ti mismo?
Dijo: Yo soy la voz del que clama en el desierto: Enderezad el camino del Señor, como dijo Isaías profeta.
Y los que habían sido enviados eran de los Fariseos.
Y preguntáronle, y dijéronle: ¿Por qué pues bautizas, si tú no eres el Cristo, ni Elías, ni el profeta?
Y Juan les respondió, diciendo: Yo bautizo con agua; mas en medio de vosotros ha estado á quien vosotros no conocéis.
Este es el que ha de venir tras mí, el cual es antes de mí: del cual yo no soy digno de desatar la correa del zapato.
Estas cosas acontecieron en Betábara, de la otra parte del Jordán, donde Juan bautizaba.
El siguiente día ve Juan á Jesús que venía á él, y dice: He aquí el Cordero de Dios, que quita el pecado del mundo.
Este es del que dije: Tras mí viene un varón, el cual es antes de mí: porque era primero que yo.
Y yo no le conocía; más para que fuese manifestado á Israel, por eso vine yo bautizando con agua.
Y Juan dió testimonio, diciendo: Vi al Espíritu que descendía del cielo como paloma, y reposó sobre él.
Y yo no le conocía; mas el que me envió á bautizar con agua, aquél me dijo: Sobre quien vieres descender el Espíritu, y que reposa sobre él, éste es el que bautiza con Espíritu Santo.
Y yo le vi, y he dado testimonio que éste es el Hijo de Dios.
El siguiente día otra vez estaba Juan, y dos de sus discípulos.
Y mirando á Jesús que andaba por allí, dijo: He aquí el Cordero de Dios.
Y oyéronle los dos discípulos hablar, y siguieron á Jesús.
Y volviéndose Jesús, y viéndolos seguirle, díceles: ¿Qué buscáis? Y ellos le dijeron: Rabbí (que declarado quiere decir Maestro) ¿dónde moras?
Díceles: Venid y ved. Vinieron, y vieron donde moraba, y quedáronse con él aquel día: porque era como la hora de las diez.
Era Andrés, hermano de Simón Pedro, uno de los dos que habían oído de Juan, y le habían seguido.
Este halló primero á su hermano Simón, y díjole: Hemos hallado al Mesías (que declarado es, el Cristo).
Y le trajo á Jesús. Y mirándole Jesús, dijo: Tú eres Simón, hijo de Jonás: tú serás llamado Cephas (que quiere decir, Piedra).
El siguiente día quiso Jesús ir á Galilea, y halla á Felipe, al cual dijo: Sígueme.
Y era Felipe de Bethsaida, la ciudad de Andrés y de Pedro.
Felipe halló á Natanael, y dícele: Hemos hallado á aquel de quien escribió Moisés en la ley, y los profetas: á Jesús, el hijo de José, de Nazaret.
Y díjole Natanael: ¿De Nazaret puede haber algo de bueno? Dícele Felipe: Ven y ve.
Jesús vió venir á sí á Natanael, y dijo de él: He aquí un verdadero Israelita, en el cual no hay engaño.
Dícele Natanael: ¿De dónde me conoces? Respondió Jesús, y díjole: Antes que Felipe te llamara, cuando estabas debajo de la higuera te vi.
Respondió Natanael, y díjole: Rabbí, tú eres el Hijo de Dios; tú eres el Rey de Israel.
Respondió Jesús y díjole: ¿Porque te dije, te vi debajo de la higuera, crees? cosas mayores que éstas verás.
Y dícele: De cierto, de cierto os digo: De aquí adelante veréis el cielo abierto, y los ángeles de Dios que suben y descienden sobre el Hijo del hombre.
Y AL tercer día hiciéronse unas bodas en Caná de Galilea; y estaba allí la madre de Jesús.
Y fué también llamado Jesús y sus discípulos á las bodas.
Y faltando el vino, la madre de Jesús le dijo: Vino no tienen.
Y dícele Jesús: ¿Qué tengo yo contigo, mujer? aun no ha venido mi hora.
Su madre dice á los que servían: Haced todo lo que os dijere.
Y estaban allí seis tinajuelas de piedra para agua, conforme á la purificación de los Judíos, que cabían en cada una dos ó tres cántaros.
Díceles Jesús: Henchid estas tinajuelas de agua. E hinchiéronlas hasta arriba.
Y díceles: Sacad ahora, y presentad al maestresala. Y presentáronle.
Y como el maestresala gustó el agua hecha vino, que no sabía de dónde era (mas lo sabían los sirvientes que habían sacado el agua), el maestresala llama al esposo,
Y dícele: Todo hombre pone primero el buen vino, y cuando están satisfechos, entonces lo que es peor; mas tú has guardado el buen vino hasta ahora.
Este principio de señales hizo Jesús en Caná de Galilea, y manifestó su gloria; y sus discípulos creyeron en él.
Después de esto descendió á Capernaum, él, y su madre, y hermanos, y discípulos; y estuvieron allí no muchos días.
Y estaba cerca la Pascua de los Judíos; y subió Jesús á Jerusalem.
Y halló en el templo á los que vendían bueyes, y ovejas, y palomas, y á los cambiadores sentados.
Y hecho un azote de cuerdas, echólos á todos del templo, y las ovejas, y los bueyes; y derramó los dineros de los cambiadores, y trastornó las mesas;
Y á los que vendían las palomas, dijo: Quitad de aquí esto, y no hagáis la casa de mi Padre casa de mercado.
Entonces se acordaron sus discípulos que está escrito: El celo de tu casa me comió.
Y los Judíos respondieron, y dijéronle: ¿Qué señal nos muestras de que haces esto?
Respondió Jesús, y díjoles: Destruid este templo, y en tres días lo levantaré.
Dijeron luego los Judíos: En cuarenta y seis años fué este templo edificado, ¿y tú en tres días lo levantarás?
Mas él hablaba del templo de su cuerpo.
Por tanto, cuando resucitó de los muertos, sus discípulos se acordaron que había dicho esto; y creyeron á la Escritura, y á la palabra que Jesús había dicho.
Y estando en Jerusalem en la Pascua, en el día de la fiesta, muchos creyeron en su nombre, viendo las señales que hacía.
Mas el mismo Jesús no se confiaba á sí mismo de ellos, porque él conocía á todos,
Y no tenía necesidad que alguien le diese testimonio del hombre; porque él sabía lo que había en el hombre.
Y HABÍA un hombre de los Fariseos que se llamaba Nicodemo, príncipe de los Judíos.
Este vino á Jesús de noche, y díjole: Rabbí, sabemos que has venido de Dios por maestro; porque nadie puede hacer estas señales que tú haces, si no fuere Dios con él.
Respondió Jesús, y díjole: De cierto, de cierto te digo, que el que no naciere otra vez, no puede ver el reino de Dios.
Dícele Nicodemo: ¿Cómo puede el hombre nacer siendo viejo? ¿puede entrar otra vez en el vientre de su madre, y nacer?
Respondió Jesús: De cierto, de cierto te digo, que el que no naciere de agua y del Espíritu, no puede entrar en el reino de Dios.
Lo que es nacido de la carne, carne es; y lo que es nacido del Espíritu, espíritu es.
No te maravilles de que te dije: Os es necesario nacer otra vez.
El viento de donde quiere sopla, y oyes su sonido; mas ni sabes de dónde viene, ni á dónde vaya: así es todo aquel que es nacido del Espíritu.
Respondió Nicodemo, y díjole: ¿Cómo puede esto hacerse?
Respondió Jesús, y díjole: ¿Tú eres el maestro de Israel, y no sabes esto?
De cierto, de cierto te digo, que lo que sabemos hablamos, y lo que hemos visto, testificamos; y no recibís nuestro testimonio.
Si os he dicho cosas terrenas, y no creéis, ¿cómo creeréis si os dijere las celestiales?
Y nadie subió al cielo, sino el que descendió del cielo, el Hijo del hombre, que está en el cielo.
Y como Moisés levantó la serpiente en el desierto, así es necesario que el Hijo del hombre sea levantado;
Para que todo aquel que en él creyere, no se pierda, sino que tenga vida eterna.
Porque de tal manera amó Dios al mundo, que ha dado á su Hijo unigénito, para que todo aquel que en él cree, no se pierda, mas tenga vida eterna.
Porque no envió Dios á su Hijo al mundo para que condene al mundo, mas para que el mundo sea salvo por él.
El que en él cree, no es condenado; mas el que no cree, ya es condenado, porque no creyó en el nombre del unigénito Hijo de Dios.
Y esta es la condenación: porque la luz vino al mundo, y los hombres amaron más las tinieblas que la luz; porque sus obras eran malas.
Porque todo aquel que hace lo malo, aborrece la luz y no viene á la luz, porque sus obras no sean redargüidas.
Mas el que obra verdad, viene á la luz, para que sus obras sean manifestadas que son hechas en Dios.
Pasado esto, vino Jesús con sus discípulos á la tierra de Judea; y estaba allí con ellos, y bautizaba.
Y bautizaba también Juan en Enón junto á Salim, porque había allí muchas aguas; y venían, y eran bautizados.
Porque Juan no había sido aún puesto en la carcel.
Y hubo cuestión entre los discípulos de Juan y los Judíos acerca de la purificación.
Y vinieron á Juan, y dijéronle: Rabbí, el que estaba contigo de la otra parte del Jordán, del cual tú diste testimonio, he aquí bautiza, y todos vienen á él.
Respondió Juan, y dijo: No puede el hombre recibir algo, si no le fuere dado del cielo.
Vosotros mismos me sois testigos que dije: Yo no soy el Cristo, sino que soy enviado delante de él.
El que tiene la esposa, es el esposo; mas el amigo del esposo, que está en pie y le oye, se goza grandemente de la voz del esposo; así pues, este mi gozo es cumplido.
A él conviene crecer, mas á mí menguar.
El que de arriba viene, sobre todos es: el que es de la tierra, terreno es, y cosas terrenas habla: el que viene del cielo, sobre todos es.
Y lo que vió y oyó, esto testifica: y nadie recibe su testimonio.
El que recibe su testimonio, éste signó que Dios es verdadero.
Porque el que Dios envió, las palabras de Dios habla: porque no da Dios el Espíritu por medida.
El Padre ama al Hijo, y todas las cosas dió en su mano.
El que cree en el Hijo, tiene vida eterna; mas el que es incrédulo al Hijo, no verá la vida, sino que la ira de Dios está sobre él.
DE manera que como Jesús entendió que los Fariseos habían oído que Jesús hacía y bautizaba más discípulos que Juan,
(Aunque Jesús no bautizaba, sino sus discípulos),
Dejó á Judea, y fuése otra vez á Galilea.
Y era menester que pasase por Samaria.
Vino, pues, á una ciudad de Samaria que se llamaba Sichâr, junto á la heredad que Jacob dió á José su hijo.
Y estaba allí la fuente de Jacob. Pues Jesús, cansado del camino, así se sentó á la fuente. Era como la hora de sexta.
Vino una mujer de Samaria á sacar agua: yJesús le dice: Dame de beber.
(Porque sus discípulos habían ido á la ciudad á comprar de comer.)
Y la mujer Samaritana le dice: ¿Cómo tú, siendo Judío, me pides á mí de beber, que soy mujer Samaritana? porque los Judíos no se tratan con los Samaritanos.
Respondió Jesús y díjole: Si conocieses el don de Dios, y quién es el que te dice: Dame de beber: tú pedirías de él, y él te daría agua viva.
La mujer le dice: Señor, no tienes con qué sacarla, y el pozo es hondo: ¿de dónde, pues, tienes el agua viva?
¿Eres tú mayor que nuestro padre Jacob, que nos dió este pozo, del cual él bebió, y sus hijos, y sus ganados?
Respondió Jesús y díjole: Cualquiera que bebiere de esta agua, volverá á tener sed;
Mas el que bebiere del agua que yo le daré, para siempre no tendrá sed: mas el agua que yo le daré, será en él una fuente de agua que salte para vida eterna.
La mujer le dice: Señor, dame esta agua, para que no tenga sed, ni venga acá á sacarla.
Jesús le dice: Ve, llama á tu marido, y ven acá.
Respondió la mujer, y dijo: No tengo marido. Dícele Jesús: Bien has dicho, No tengo marido;
Porque cinco maridos has tenido: y el que ahora tienes no es tu marido; esto has dicho con verdad.
Dícele la mujer: Señor, paréceme que tú eres profeta.
Nuestros padres adoraron en este monte, y vosotros decís que en Jerusalem es el lugar donde es necesario adorar.
Dícele Jesús: Mujer, créeme, que la hora viene, cuando ni en este monte, ni en Jerusalem adoraréis al Padre.
Vosotros adoráis lo que no sabéis; nosotros adoramos lo que sabemos: porque la salud viene de los Judíos.
Mas la hora viene, y ahora es, cuando los verdaderos adoradores adorarán al Padre en espíritu y en verdad; porque también el Padre tales adoradores busca que le adoren.
Dios es Espíritu; y los que le adoran, en espíritu y en verdad es necesario que adoren.
Dícele la mujer: Sé que el Mesías ha de venir, el cual se dice el Cristo: cuando él viniere nos declarará todas las cosas.
Dícele Jesús: Yo soy, que hablo contigo.
Y en esto vinieron sus discípulos, y maravilláronse de que hablaba con mujer; mas ninguno dijo: ¿Qué preguntas? ó, ¿Qué hablas con ella?
Entonces la mujer dejó su cántaro, y fué á la ciudad, y dijo á aquellos hombres:
Venid, ved un hombre que me ha dicho todo lo que he hecho: ¿si quizás es éste el Cristo?
Entonces salieron de la ciudad, y vinieron á él.
Entre tanto los discípulos le rogaban, diciendo: Rabbí, come.
Y él les dijo: Yo tengo una comida que comer, que vosotros no sabéis.
Entonces los discípulos decían el uno al otro: ¿Si le habrá traído alguien de comer?
Díceles Jesús: Mi comida es que haga la voluntad del que me envió, y que acabe su obra.
¿No decís vosotros: Aun hay cuatro meses hasta que llegue la siega? He aquí os digo: Alzad vuestros ojos, y mirad las regiones, porque ya están blancas para la siega.
Y el que siega, recibe salario, y allega fruto para vida eterna; para que el que siembra también goce, y el que siega.
Porque en esto es el dicho verdadero: Que uno es el que siembra, y otro es el que siega.
Yo os he enviado á segar lo que vosotros no labrasteis: otros labraron, y vosotros habéis entrado en sus labores.
Y muchos de los Samaritanos de aquella ciudad creyeron en él por la palabra de la mujer, que daba testimonio, diciendo: Que me dijo todo lo que he hecho.
Viniendo pues los Samaritanos á él, rogáronle que se quedase allí: y se quedó allí dos días.
Y creyeron muchos más por la palabra de él.
Y decían á la mujer: Ya no creemos por tu dicho; porque nosotros mismos hemos oído, y sabemos que verdaderamente éste es el Salvador del mundo, el Cristo.
Y dos días después, salió de allí, y fuése á Galilea.
Porque el mismo Jesús dió testimonio de que el profeta en su tierra no tiene honra.
Y como vino á Galilea, los Galileos le recibieron, vistas todas las cosas que había hecho en Jerusalem en el día de la fiesta: porque también ellos habían ido á la fiesta.
Vino pues Jesús otra vez á Caná de Galilea, donde había hecho el vino del agua. Y había en Capernaum uno del rey, cuyo hijo estaba enfermo.
Este, como oyó que Jesús venía de Judea á Galilea, fué á él, y rogábale que descendiese, y sanase á su hijo, porque se comenzaba á morir.
Entonces Jesús le dijo: Si no viereis señales y milagros no creeréis.
El del rey le dijo: Señor, desciende antes que mi hijo muera.
Dícele Jesús: Ve, tu hijo vive. Y el hombre creyó á la palabra que Jesús le dijo, y se fué.
Y cuando ya él descendía, los siervos le salieron á recibir, y le dieron nuevas, diciendo: Tu hijo vive.
Entonces él les preguntó á qué hora comenzó á estar mejor. Y dijéronle: Ayer á las siete le dejó la fiebre.
El padre entonces entendió, que aquella hora era cuando Jesús le dijo: Tu hijo vive; y creyó él y toda su casa.
Esta segunda señal volvió Jesús á hacer, cuando vino de Judea á Galilea.
DESPUÉS de estas cosas, era un día de fiesta de los Judíos, y subió Jesús á Jerusalem.
Y hay en Jerusalem á la puerta del ganado un estanque, que en hebraico es llamado Bethesda, el cual tiene cinco portales.
En éstos yacía multitud de enfermos, ciegos, cojos, secos, que estaban esperando el movimiento del agua.
Porque un ángel descendía á cierto tiempo al estanque, y revolvía el agua; y el que primero descendía en el estanque después del movimiento del agua, era sano de cualquier enfermedad que tuviese.
Y estaba allí un hombre que había treinta y ocho años que estaba enfermo.
Como Jesús vió á éste echado, y entendió que ya había mucho tiempo, dícele: ¿Quieres ser sano?
Señor, le respondió el enfermo, no tengo hombre que me meta en el estanque cuando el agua fuere revuelta; porque entre tanto que yo vengo, otro antes de mí ha descendido.
Dícele Jesús: Levántate, toma tu lecho, y anda.
Y luego aquel hombre fué sano, y tomó su lecho, é íbase. Y era sábado aquel día.
Entonces los Judíos decían á aquel que había sido sanado: Sábado es: no te es lícito llevar tu lecho.
Respondióles: El que me sanó, él mismo me dijo: Toma tu lecho y anda.
Preguntáronle entonces: ¿Quién es el que te dijo: Toma tu lecho y anda?
Y el que había sido sanado, no sabía quién fuese; porque Jesús se había apartado de la gente que estaba en aquel lugar.
Después le halló Jesús en el templo, y díjole: He aquí, has sido sanado; no peques más, porque no te venga alguna cosa peor.
El se fué, y dió aviso á los Judíos, que Jesús era el que le había sanado.
Y por esta causa los Judíos perseguían á Jesús, y procuraban matarle, porque hacía estas cosas en sábado.
Y Jesús les respondió: Mi Padre hasta ahora obra, y yo obro.
Entonces, por tanto, más procuraban los Judíos matarle, porque no sólo quebrantaba el sábado, sino que también á su Padre llamaba Dios, haciéndose igual á Dios.
Porque el Padre ama al Hijo, y le muestra todas las cosas que él hace; y mayores obras que éstas le mostrará, de suerte que vosotros os maravilléis.
Porque como el Padre levanta los muertos, y les da vida, así también el Hijo á los que quiere da vida.
Porque el Padre á nadie juzga, mas todo el juicio dió al Hijo;
Para que todos honren al Hijo como honran al Padre. El que no honra al Hijo, no honra al Padre que le envió.
De cierto, de cierto os digo: El que oye mi palabra, y cree al que me ha enviado, tiene vida eterna; y no vendrá á condenación, mas pasó de muerte á vida.
De cierto, de cierto os digo: Vendrá hora, y ahora es, cuando los muertos oirán la voz del Hijo de Dios: y los que oyeren vivirán.
Porque como el Padre tiene vida en sí mismo, así dió también al Hijo que tuviese vida en sí mismo:
Y también le dió poder de hacer juicio, en cuanto es el Hijo del hombre.
No os maravilléis de esto; porque vendrá hora, cuando todos los que están en los sepulcros oirán su voz;
Y los que hicieron bien, saldrán á resurrección de vida; mas los que hicieron mal, á resurrección de condenación.
No puedo yo de mí mismo hacer nada: como oigo, juzgo: y mi juicio es justo; porque no busco mi voluntad, mas la voluntad del que me envió, del Padre.
Si yo doy testimonio de mí mismo, mi testimonio no es verdadero.
Otro es el que da testimonio de mí; y sé que el testimonio que da de mí, es verdadero.
Vosotros enviasteis á Juan, y él dió testimonio á la verdad.
Empero yo no tomo el testimonio de hombre; mas digo esto, para que vosotros seáis salvos.
El era antorcha que ardía y alumbraba: y vosotros quisisteis recrearos por un poco á su luz.
Mas yo tengo mayor testimonio que el de Juan: porque las obras que el Padre me dió que cumpliese, las mismas obras que yo hago, dan testimonio de mí, que el Padre me haya enviado.
Y el que me envió, el Padre, él ha dado testimonio de mí. Ni nunca habéis oído su voz, ni habéis visto su parecer.
Ni tenéis su palabra permanente en vosotros; porque al que él envió, á éste vosotros no creéis.
Escudriñad las Escrituras, porque á vosotros os parece que en ellas tenéis la vida eterna; y ellas son las que dan testimonio de mí.
Y no queréis venir á mí, para que tengáis vida.
Gloria de los hombres no recibo.
Mas yo os conozco, que no tenéis amor de Dios en vosotros.
Yo he venido en nombre de mi Padre, y no me recibís: si otro viniere en su propio nombre, á aquél recibiréis.
¿Cómo podéis vosotros creer, pues tomáis la gloria los unos de los otros, y no buscáis la gloria que de sólo Dios viene?
No penséis que yo os tengo de acusar delante del Padre; hay quien os acusa, Moisés, en quien vosotros esperáis.
Porque si vosotros creyeseis á Moisés, creeríais á mí; porque de mí escribió él.
Y si á sus escritos no creéis, ¿cómo creeréis á mis palabras?
PASADAS estas cosas, fuése Jesús de la otra parte de la mar de Galilea, que es de Tiberias.
Y seguíale grande multitud, porque veían sus señales que hacía en los enfermos.
Y subió Jesús á un monte, y se sentó allí con sus discípulos.
Y estaba cerca la Pascua, la fiesta de los Judíos.
Y como alzó Jesús los ojos, y vió que había venido á él grande multitud, dice á Felipe: ¿De dónde compraremos pan para que coman éstos?
Mas esto decía para probarle; porque él sabía lo que había de hacer.
Respondióle Felipe: Doscientos denarios de pan no les bastarán, para que cada uno de ellos tome un poco.
Dícele uno de sus discípulos, Andrés, hermano de Simón Pedro:
Un muchacho está aquí que tiene cinco panes de cebada y dos pececillos; ¿mas qué es esto entre tantos?
Entonces Jesús dijo: Haced recostar la gente. Y había mucha hierba en aquel lugar: y recostáronse como número de cinco mil varones.
Y tomó Jesús aquellos panes, y habiendo dado gracias, repartió á los discípulos, y los discípulos á los que estaban recostados: asimismo de los peces, cuanto querían.
Y como fueron saciados, dijo á sus discípulos: Recoged los pedazos que han quedado, porque no se pierda nada.
Cogieron pues, é hinchieron doce cestas de pedazos de los cinco panes de cebada, que sobraron á los que habían comido.
Aquellos hombres entonces, como vieron la señal que Jesús había hecho, decían: Este verdaderamente es el profeta que había de venir al mundo.
Y entendiendo Jesús que habían de venir para arrebatarle, y hacerle rey, volvió á retirarse al monte, él solo.
Y como se hizo tarde, descendieron sus discípulos á la mar;
Y entrando en un barco, venían de la otra parte de la mar hacia Capernaum. Y era ya oscuro, y Jesús no había venido á ellos.
Y levantábase la mar con un gran viento que soplaba.
Y como hubieron navegado como veinticinco ó treinta estadios, ven á Jesús que andaba sobre la mar, y se acercaba al barco: y tuvieron miedo.
Mas él les dijo: Yo soy; no tengáis miedo.
Ellos entonces gustaron recibirle en el barco: y luego el barco llegó á la tierra donde iban.
Y que otras navecillas habían arribado de Tiberias junto al lugar donde habían comido el pan después de haber el Señor dado gracias;
Como vió pues la gente que Jesús no estaba allí, ni sus discípulos, entraron ellos en las navecillas, y vinieron á Capernaum buscando á Jesús.
Y hallándole de la otra parte de la mar, dijéronle: Rabbí, ¿cuándo llegaste acá?
Respondióles Jesús, y dijo: De cierto, de cierto os digo, que me buscáis, no porque habéis visto las señales, sino porque comisteis el pan y os hartasteis.
Trabajad no por la comida que perece, mas por la comida que á vida eterna permanece, la cual el Hijo del hombre os dará: porque á éste señaló el Padre, que es Dios.
Y dijéronle: ¿Qué haremos para que obremos las obras de Dios?
Respondió Jesús, y díjoles: Esta es la obra de Dios, que creáis en el que él ha enviado.
Dijéronle entonces: ¿Qué señal pues haces tú, para que veamos, y te creamos? ¿Qué obras?
Nuestros padres comieron el maná en el desierto, como está escrito: Pan del cielo les dió á comer.
Y Jesús les dijo: De cierto, de cierto os digo: No os dió Moisés pan del cielo; mas mi Padre os da el verdadero pan del cielo.
Porque el pan de Dios es aquel que descendió del cielo y da vida al mundo.
Y dijéronle: Señor, danos siempre este pan.
Y Jesús les dijo: Yo soy el pan de vida: el que á mí viene, nunca tendrá hambre; y el que en mí cree, no tendrá sed jamás.
Mas os he dicho, que aunque me habéis visto, no creéis.
Todo lo que el Padre me da, vendrá á mí; y al que á mí viene, no le hecho fuera.
Porque he descendido del cielo, no para hacer mi voluntad, mas la voluntad del que me envió.
Y esta es la voluntad del que me envió, del Padre: Que todo lo que me diere, no pierda de ello, sino que lo resucite en el día postrero.
Y esta es la voluntad del que me ha enviado: Que todo aquel que ve al Hijo, y cree en él, tenga vida eterna: y yo le resucitaré en el día postrero.
Murmuraban entonces de él los Judíos, porque había dicho: Yo soy el pan que descendí del cielo.
Y decían: ¿No es éste Jesús, el hijo de José, cuyo padre y madre nosotros conocemos? ¿cómo, pues, dice éste: Del cielo he descendido?
Y Jesús respondió, y díjoles: No murmuréis entre vosotros.
Ninguno puede venir á mí, si el Padre que me envió no le trajere; y yo le resucitaré en el día postrero.
Escrito está en los profetas: Y serán todos enseñados de Dios. Así que, todo aquel que oyó del Padre, y aprendió, viene á mí.
No que alguno haya visto al Padre, sino aquel que vino de Dios, éste ha visto al Padre.
De cierto, de cierto os digo: El que cree en mí, tiene vida eterna.
Yo soy el pan de vida.
Vuestros padres comieron el maná en el desierto, y son muertos.
Este es el pan que desciende del cielo, para que el que de él comiere, no muera.
Yo soy el pan vivo que he descendido del cielo: si alguno comiere de este pan, vivirá para siempre; y el pan que yo daré es mi carne, la cual yo daré por la vida del mundo.
Entonces los Judíos contendían entre sí, diciendo: ¿Cómo puede éste darnos su carne á comer?
Y Jesús les dijo: De cierto, de cierto os digo: Si no comiereis la carne del Hijo del hombre, y bebiereis su sangre, no tendréis vida en vosotros.
El que come mi carne y bebe mi sangre, tiene vida eterna: y yo le resucitaré en el día postrero.
Porque mi carne es verdadera comida, y mi sangre es verdadera bebida.
El que come mi carne y bebe mi sangre, en mí permanece, y yo en él.
Como me envió el Padre viviente, y yo vivo por el Padre, asimismo el que me come, él también vivirá por mí.
Este es el pan que descendió del cielo: no como vuestros padres comieron el maná, y son muertos: el que come de este pan, vivirá eternamente.
Estas cosas dijo en la sinagoga, enseñando en Capernaum.
Y muchos de sus discípulos oyéndolo, dijeron: Dura es esta palabra: ¿quién la puede oir?
Y sabiendo Jesús en sí mismo que sus discípulos murmuraban de esto, díjoles: ¿Esto os escandaliza?
¿Pues qué, si viereis al Hijo del hombre que sube donde estaba primero?
El espíritu es el que da vida; la carne nada aprovecha: las palabras que yo os he hablado, son espíritu, y son vida.
Mas hay algunos de vosotros que no creen. Porque Jesús desde el principio sabía quiénes eran los que no creían, y quién le había de entregar.
Y dijo: Por eso os he dicho que ninguno puede venir á mí, si no le fuere dado del Padre.
Desde esto, muchos de sus discípulos volvieron atrás, y ya no andaban con él.
Dijo entonces Jesús á los doce: ¿Queréis vosotros iros también?
Y respondióle Simón Pedro: Señor, ¿á quién iremos? tú tienes palabras de vida eterna.
Y nosotros creemos y conocemos que tú eres el Cristo, el Hijo de Dios viviente.
Jesús le respondió: ¿No he escogido yo á vosotros doce, y uno de vosotros es diablo?
Y hablaba de Judas Iscariote, hijo de Simón, porque éste era el que le había de entregar, el cual era uno de los doce.
Y PASADAS estas cosas andaba Jesús en Galilea: que no quería andar en Judea, porque los Judíos procuraban matarle.
Y estaba cerca la fiesta de los Judíos, lade los tabernáculos.
Y dijéronle sus hermanos: Pásate de aquí, y vete á Judea, para que también tus discípulos vean las obras que haces.
Que ninguno que procura ser claro, hace algo en oculto. Si estas cosas haces, manifiéstate al mundo.
Porque ni aun sus hermanos creían en él.
Díceles entonces Jesús: Mi tiempo aun no ha venido; mas vuestro tiempo siempre está presto.
No puede el mundo aborreceros á vosotros; mas á mí me aborrece, porque yo doy testimonio de él, que sus obras son malas.
Vosotros subid á esta fiesta; yo no subo aún á esta fiesta, porque mi tiempo aun no es cumplido.
Y habiéndoles dicho esto, quedóse en Galilea.
Mas como sus hermanos hubieron subido, entonces él también subió á la fiesta, no manifiestamente, sino como en secreto.
Y buscábanle los Judíos en la fiesta, y decían: ¿Dónde está aquél?
Y había grande murmullo de él entre la gente: porque unos decían: Bueno es; y otros decían: No, antes engaña á las gentes.
Mas ninguno hablaba abiertamente de él, por miedo de los Judíos.
Y al medio de la fiesta subió Jesús al templo, y enseñaba.
Y maravillábanse los Judíos, diciendo: ¿Cómo sabe éste letras, no habiendo aprendido?
Respondióles Jesús, y dijo: Mi doctrina no es mía, sino de aquél que me envió.
El que quisiere hacer su voluntad, conocerá de la doctrina si viene de Dios, ó si yo hablo de mí mismo.
El que habla de sí mismo, su propia gloria busca; mas el que busca la gloria del que le envió, éste es verdadero, y no hay en él injusticia.
¿No os dió Moisés la ley, y ninguno de vosotros hace la ley? ¿Por qué me procuráis matar?
Respondió la gente, y dijo: Demonio tienes: ¿quién te procura matar?
Jesús respondió, y díjoles: Una obra hice, y todos os maravilláis.
Cierto, Moisés os dió la circuncisión (no porque sea de Moisés, mas de los padres); y en sábado circuncidáis al hombre.
Si recibe el hombre la circuncisión en sábado, para que la ley de Moisés no sea quebrantada, ¿os enojáis conmigo porque en sábado hice sano todo un hombre?
No juzguéis según lo que parece, mas juzgad justo juicio.
Decían entonces unos de los de Jerusalem: ¿No es éste al que buscan para matarlo?
Y he aquí, habla públicamente, y no le dicen nada; ¿si habrán entendido verdaderamente los príncipes, que éste es el Cristo?
Mas éste, sabemos de dónde es: y cuando viniere el Cristo, nadie sabrá de dónde sea.
Entonces clamaba Jesús en el templo, enseñando y diciendo: Y á mí me conocéis, y sabéis de dónde soy; y no he venido de mí mismo; mas el que me envió es verdadero, al cual vosotros no conocéis.
Yo le conozco, porque de él soy, y él me envió.
Entonces procuraban prenderle; mas ninguno puso en él mano, porque aun no había venido su hora.
Y muchos del pueblo creyeron en él, y decían: El Cristo, cuando viniere, ¿hará más señales que las que éste hace?
Los Fariseos oyeron á la gente que murmuraba de él estas cosas; y los príncipes de los sacerdotes y los Fariseos enviaron servidores que le prendiesen.
Y Jesús dijo: Aun un poco de tiempo estaré con vosotros, é iré al que me envió.
Me buscaréis, y no me hallaréis; y donde yo estaré, vosotros no podréis venir.
Entonces los Judíos dijeron entre sí: ¿A dónde se ha de ir éste que no le hallemos? ¿Se ha de ir á los esparcidos entre los Griegos, y á enseñar á los Griegos?
¿Qué dicho es éste que dijo: Me buscaréis, y no me hallaréis; y donde yo estaré, vosotros no podréis venir?
Mas en el postrer día grande de la fiesta, Jesús se ponía en pie y clamaba, diciendo: Si alguno tiene sed, venga á mí y beba.
El que cree en mí, como dice la Escritura, ríos de agua viva correrán de su vientre.
(Y esto dijo del Espíritu que habían de recibir los que creyesen en él: pues aun no había venido el Espíritu Santo; porque Jesús no estaba aún glorificado.)
Entonces algunos de la multitud, oyendo este dicho, decían: Verdaderamente éste es el profeta.
Otros decían: Este es el Cristo. Algunos empero decían: ¿De Galilea ha de venir el Cristo?
¿No dice la Escritura, que de la simiente de David, y de la aldea de Bethlehem, de donde era David, vendrá el Cristo?
Así que había disensión entre la gente acerca de él.
Y algunos de ellos querían prenderle; mas ninguno echó sobre él manos.
Y los ministriles vinieron á los principales sacerdotes y á los Fariseos; y ellos les dijeron: ¿Por qué no le trajisteis?
Los ministriles respondieron: Nunca ha hablado hombre así como este hombre.
Entonces los Fariseos les respondieron: ¿Estáis también vosotros engañados?
¿Ha creído en él alguno de los príncipes, ó de los Fariseos?
Mas estos comunales que no saben la ley, malditos son.
Díceles Nicodemo (el que vino á él de noche, el cual era uno de ellos):
¿Juzga nuestra ley á hombre, si primero no oyere de él, y entendiere lo que ha hecho?
Respondieron y dijéronle: ¿Eres tú también Galileo? Escudriña y ve que de Galilea nunca se levantó profeta.
Y fuése cada uno á su casa.
Y JESÚS se fué al monte de las Olivas.
Y por la mañana volvió al templo, y todo el pueblo vino á él: y sentado él, los enseñaba.
Entonces los escribas y los Fariseos le traen una mujer tomada en adulterio; y poniéndola en medio,
Dícenle: Maestro, esta mujer ha sido tomada en el mismo hecho, adulterando;
Y en la ley Moisés nos mandó apedrear á las tales: tú pues, ¿qué dices?
Mas esto decían tentándole, para poder acusarle. Empero Jesús, inclinado hacia abajo, escribía en tierra con el dedo.
Y como perseverasen preguntándole, enderezóse, y díjoles: El que de vosotros esté sin pecado, arroje contra ella la piedra el primero.
Y volviéndose á inclinar hacia abajo, escribía en tierra.
Oyendo, pues, ellos, redargüidos de la conciencia, salíanse uno á uno, comenzando desde los más viejos hasta los postreros: y quedó solo Jesús, y la mujer que estaba en medio.
Y enderezándose Jesús, y no viendo á nadie más que á la mujer, díjole: ¿Mujer, dónde están los que te acusaban? ¿Ninguno te ha condenado?
Y ella dijo: Señor, ninguno. Entonces Jesús le dijo: Ni yo te condeno: vete, y no peques más.
Y hablóles Jesús otra vez, diciendo: Yo soy la luz del mundo: el que me sigue, no andará en tinieblas, mas tendrá la lumbre de la vida.
Entonces los Fariseos le dijeron: Tú de ti mismo das testimonio: tu testimonio no es verdadero.
Respondió Jesús, y díjoles: Aunque yo doy testimonio de mí mismo, mi testimonio es verdadero, porque sé de dónde he venido y á dónde voy; mas vosotros no sabéis de dónde vengo, y á dónde voy.
Vosotros según la carne juzgáis; mas yo no juzgo á nadie.
Y si yo juzgo, mi juicio es verdadero; porque no soy solo, sino yo y el que me envió, el Padre.
Y en vuestra ley está escrito que el testimonio de dos hombres es verdadero.
Yo soy el que doy testimonio de mí mismo: y da testimonio de mí el que me envió, el Padre.
Y decíanle: ¿Dónde está tu Padre? Respondió Jesús: Ni á mí me conocéis, ni á mi Padre; si á mí me conocieseis, á mi Padre también conocierais.
Estas palabras habló Jesús en el lugar de las limosnas, enseñando en el templo: y nadie le prendió; porque aun no había venido su hora.
Y díjoles otra vez Jesús: Yo me voy, y me buscaréis, mas en vuestro pecado moriréis: á donde yo voy, vosotros no podéis venir.
Decían entonces los Judíos: ¿Hase de matar á sí mismo, que dice: A donde yo voy, vosotros no podéis venir?
Y decíales: Vosotros sois de abajo, yo soy de arriba; vosotros sois de este mundo, yo no soy de este mundo.
Por eso os dije que moriréis en vuestros pecados; porque si no creyereis que yo soy, en vuestros pecados moriréis.
Y decíanle: ¿Tú quién eres? Entonces Jesús les dijo: El que al principio también os he dicho.
Muchas cosas tengo que decir y juzgar de vosotros: mas el que me envió, es verdadero: y yo, lo que he oído de él, esto hablo en el mundo.
Mas no entendieron que él les hablaba del Padre.
Díjoles pues, Jesús: Cuando levantareis al Hijo del hombre, entonces entenderéis que yo soy, y que nada hago de mí mismo; mas como el Padre me enseñó, esto hablo.
Porque el que me envió, conmigo está; no me ha dejado solo el Padre; porque yo, lo que á él agrada, hago siempre.
Hablando él estas cosas, muchos creyeron en él.
Y decía Jesús á los Judíos que le habían creído: Si vosotros permaneciereis en mi palabra, seréis verdaderamente mis discípulos;
Y conoceréis la verdad, y la verdad os libertará.
Y respondiéronle: Simiente de Abraham somos, y jamás servimos á nadie: ¿cómo dices tú: Seréis libres?
Jesús les respondió: De cierto, de cierto os digo, que todo aquel que hace pecado, es siervo de pecado.
Y el siervo no queda en casa para siempre: el hijo queda para siempre.
Así que, si el Hijo os libertare, seréis verdaderamente libres.
Sé que sois simiente de Abraham, mas procuráis matarme, porque mi palabra no cabe en vosotros.
Yo hablo lo que he visto cerca del Padre; y vosotros hacéis lo que habéis oído cerca de vuestro padre.
Respondieron y dijéronle: Nuestro padre es Abraham. Díceles Jesús: Si fuerais hijos de Abraham, las obras de Abraham haríais.
Empero ahora procuráis matarme, hombre que os he hablado la verdad, la cual he oído de Dios: no hizo esto Abraham.
Vosotros hacéis las obras de vuestro padre. Dijéronle entonces: Nosotros no somos nacidos de fornicación; un padre tenemos, que es Dios.
Jesús entonces les dijo: Si vuestro padre fuera Dios, ciertamente me amaríais: porque yo de Dios he salido, y he venido; que no he venido de mí mismo, mas él me envió.
¿Por qué no reconocéis mi lenguaje? porque no podéis oir mi palabra.
Y porque yo digo verdad, no me creéis.
¿Quién de vosotros me redarguye de pecado? Pues si digo verdad, ¿por qué vosotros no me creéis?
El que es de Dios, las palabras de Dios oye: por esto no las oís vosotros, porque no sois de Dios.
Respondieron entonces los Judíos, y dijéronle: ¿No decimos bien nosotros, que tú eres Samaritano, y tienes demonio?
Respondió Jesús: Yo no tengo demonio, antes honro á mi Padre; y vosotros me habéis deshonrado.
Y no busco mi gloria: hay quien la busque, y juzgue.
De cierto, de cierto os digo, que el que guardare mi palabra, no verá muerte para siempre.
Entonces los Judíos le dijeron: Ahora conocemos que tienes demonio. Abraham murió, y los profetas, y tú dices: El que guardare mi palabra, no gustará muerte para siempre.
¿Eres tú mayor que nuestro padre Abraham, el cual murió? y los profetas murieron: ¿quién te haces á ti mismo?
Respondió Jesús: Si yo me glorifico á mí mismo, mi gloria es nada: mi Padre es el que me glorifica; el que vosotros decís que es vuestro Dios;
Y no le conocéis: mas yo le conozco; y si dijere que no le conozco, seré como vosotros mentiroso: mas le conozco, y guardo su palabra.
Abraham vuestro padre se gozó por ver mi día; y lo vió, y se gozó.
Dijéronle entonces los Judíos: Aun no tienes cincuenta años, ¿y has visto á Abraham?
Díjoles Jesús: De cierto, de cierto os digo: Antes que Abraham fuese, yo soy.
Tomaron entonces piedras para tirarle: mas Jesús se encubrió, y salió del templo; y atravesando por medio de ellos, se fué.
Y PASANDOJesús, vió un hombre ciego desde su nacimiento.
Y preguntáronle sus discípulos, diciendo: Rabbí, ¿quién pecó, éste ó sus padres, para que naciese ciego?
Respondió Jesús: Ni éste pecó, ni sus padres: mas para que las obras de Dios se manifiesten en él.
Conviéneme obrar las obras del que me envió, entre tanto que el día dura: la noche viene, cuando nadie puede obrar.
Entre tanto que estuviere en el mundo, luz soy del mundo.
Esto dicho, escupió en tierra, é hizo lodo con la saliva, y untó con el lodo sobre los ojos del ciego,
Y díjole: Ve, lávate en el estanque de Siloé (que significa, si lo interpretares, Enviado). Y fué entonces, y lavóse, y volvió viendo.
Entonces los vecinos, y los que antes le habían visto que era ciego, decían: ¿No es éste el que se sentaba y mendigaba?
Unos decían: Este es; y otros: A él se parece. El decía: Yo soy.
Y dijéronle: ¿Cómo te fueron abiertos los ojos?
Respondió él y dijo: El hombre que se llama Jesús, hizo lodo, y me untó los ojos, y me dijo: Ve al Siloé, y lávate: y fuí, y me lavé, y recibí la vista.
Entonces le dijeron: ¿Dónde está aquél? El dijo: No sé.
Llevaron á los Fariseos al que antes había sido ciego.
Y era sábado cuando Jesús había hecho el lodo, y le había abierto los ojos.
Y volviéronle á preguntar también los Fariseos de qué manera había recibido la vista. Y él les dijo: Púsome lodo sobre los ojos, y me lavé, y veo.
Entonces unos de los Fariseos decían: Este hombre no es de Dios, que no guarda el sábado. Otros decían: ¿Cómo puede un hombre pecador hacer estas señales? Y había disensión entre ellos.
Vuelven á decir al ciego: ¿Tú, qué dices del que te abrió los ojos? Y él dijo: Que es profeta.
Mas los Judíos no creían de él, que había sido ciego, y hubiese recibido la vista, hasta que llamaron á los padres del que había recibido la vista;
Y preguntáronles, diciendo: ¿Es éste vuestro hijo, el que vosotros decís que nació ciego? ¿Cómo, pues, ve ahora?
Respondiéronles sus padres y dijeron: Sabemos que éste es nuestro hijo, y que nació ciego:
Mas cómo vea ahora, no sabemos; ó quién le haya abierto los ojos, nosotros no lo sabemos; él tiene edad, preguntadle á él; él hablará de sí.
Esto dijeron sus padres, porque tenían miedo de los Judíos: porque ya los Judíos habían resuelto que si alguno confesase ser él el Mesías, fuese fuera de la sinagoga.
Por eso dijeron sus padres: Edad tiene, preguntadle á él.
Así que, volvieron á llamar al hombre que había sido ciego, y dijéronle: Da gloria á Dios: nosotros sabemos que este hombre es pecador.
Entonces él respondió, y dijo: Si es pecador, no lo sé: una cosa sé, que habiendo yo sido ciego, ahora veo.
Y volviéronle á decir: ¿Qué te hizo? ¿Cómo te abrió los ojos?
Respondióles: Ya os lo he dicho, y no habéis atendido: ¿por qué lo queréis otra vez oir? ¿queréis también vosotros haceros sus discípulos?
Y le ultrajaron, y dijeron: Tú eres su discípulo; pero nosotros discípulos de Moisés somos.
Nosotros sabemos que á Moisés habló Dios: mas éste no sabemos de dónde es.
Respondió aquel hombre, y díjoles: Por cierto, maravillosa cosa es ésta, que vosotros no sabéis de dónde sea, y á mí me abrió los ojos.
Y sabemos que Dios no oye á los pecadores: mas si alguno es temeroso de Dios, y hace su voluntad, á éste oye.
Desde el siglo no fué oído, que abriese alguno los ojos de uno que nació ciego.
Si éste no fuera de Dios, no pudiera hacer nada.
Respondieron, y dijéronle: En pecados eres nacido todo, ¿y tú nos enseñas? Y echáronle fuera.
Oyó Jesús que le habían echado fuera; y hallándole, díjole: ¿Crees tú en el Hijo de Dios?
Respondió él, y dijo: ¿Quién es, Señor, para que crea en él?
Y díjole Jesús: Y le has visto, y el que habla contigo, él es.
Y él dice: Creo, Señor; y adoróle.
Y dijo Jesús: Yo, para juicio he venido á este mundo: para que los que no ven, vean; y los que ven, sean cegados.
Y ciertos de los Fariseos que estaban con él oyeron esto, y dijéronle: ¿Somos nosotros también ciegos?
Díjoles Jesús: Si fuerais ciegos, no tuvierais pecado: mas ahora porque decís, Vemos, por tanto vuestro pecado permanece.
DE cierto, de cierto os digo: El que no entra por la puerta en el corral de las ovejas, mas sube por otra parte, el tal es ladrón y robador.
Mas el que entra por la puerta, el pastor de las ovejas es.
A éste abre el portero, y las ovejas oyen su voz: y á sus ovejas llama por nombre, y las saca.
Y como ha sacado fuera todas las propias, va delante de ellas; y las ovejas le siguen, porque conocen su voz.
Mas al extraño no seguirán, antes huirán de él: porque no conocen la voz de los extraños.
Esta parábola les dijo Jesús; mas ellos no entendieron qué era lo que les decía.
Volvióles, pues, Jesús á decir: De cierto, de cierto os digo: Yo soy la puerta de las ovejas.
Todos los que antes de mí vinieron, ladrones son y robadores; mas no los oyeron las ovejas.
Yo soy la puerta: el que por mí entrare, será salvo; y entrará, y saldrá, y hallará pastos.
El ladrón no viene sino para hurtar, y matar, y destruir: yo he venido para que tengan vida, y para quelatengan en abundancia.
Yo soy el buen pastor: el buen pastor su vida da por las ovejas.
Mas el asalariado, y que no es el pastor, de quien no son propias las ovejas, ve al lobo que viene, y deja las ovejas, y huye, y el lobo las arrebata, y esparce las ovejas.
Así que, el asalariado, huye, porque es asalariado, y no tiene cuidado de las ovejas.
Yo soy el buen pastor; y conozco mis ovejas, y las mías me conocen.
Como el Padre me conoce, y yo conozco al Padre; y pongo mi vida por las ovejas.
También tengo otras ovejas que no son de este redil; aquéllas también me conviene traer, y oirán mi voz; y habrá un rebaño, y un pastor.
Por eso me ama el Padre, porque yo pongo mi vida, para volverla á tomar.
Nadie me la quita, mas yo la pongo de mí mismo. Tengo poder para ponerla, y tengo poder para volverla á tomar. Este mandamiento recibí de mi Padre.
Y volvió á haber disensión entre los Judíos por estas palabras.
Y muchos de ellos decían: Demonio tiene, y está fuera de sí; ¿para qué le oís?
Decían otros: Estas palabras no son de endemoniado: ¿puede el demonio abrir los ojos de los ciegos?
Y se hacía la fiesta de la dedicación en Jerusalem; y era invierno;
Y Jesús andaba en el templo por el portal de Salomón.
Y rodeáronle los Judíos y dijéronle: ¿Hasta cuándo nos has de turbar el alma? Si tú eres el Cristo, dínoslo abiertamente.
Respondióles Jesús: Os lo he dicho, y no creéis: las obras que yo hago en nombre de mi Padre, ellas dan testimonio de mí;
Mas vosotros no creéis, porque no sois de mis ovejas, como os he dicho.
Mis ovejas oyen mi voz, y yo las conozco, y me siguen;
Y yo les doy vida eterna: y no perecerán para siempre, ni nadie las arrebatará de mi mano.
Mi Padre que me las dió, mayor que todos es: y nadie las puede arrebatar de la mano de mi Padre.
Yo y el Padre una cosa somos.
Entonces volvieron á tomar piedras los Judíos para apedrearle.
Respondióles Jesús: Muchas buenas obras os he mostrado de mi Padre; ¿por cuál obra de esas me apedreáis?
Respondiéronle los Judíos, diciendo: Por buena obra no te apedreamos, sino por la blasfemia; y porque tú, siendo hombre, te haces Dios.
Respondióles Jesús: ¿No está escrito en vuestra ley: Yo dije, Dioses sois?
Si dijo, dioses, á aquellos á los cuales fué hecha palabra de Dios (y la Escritura no puede ser quebrantada);
¿A quien el Padre santificó y envió al mundo, vosotros decís: Tú blasfemas, porque dije: Hijo de Dios soy?
Si no hago obras de mi Padre, no me creáis.
Mas si las hago, aunque á mí no creáis, creed á las obras; para que conozcáis y creáis que el Padre está en mí, y yo en el Padre.
Y procuraban otra vez prenderle; mas él se salió de sus manos;
Y volvióse tras el Jordán, á aquel lugar donde primero había estado bautizando Juan; y estúvose allí.
Y muchos venían á él, y decían: Juan, á la verdad, ninguna señal hizo; mas todo lo que Juan dijo de éste, era verdad.
Y muchos creyeron allí en él.
ESTABA entonces enfermo unollamadoLázaro, de Bethania, la aldea de María y de Marta su hermana.
(Y María, cuyo hermano Lázaro estaba enfermo, era la que ungió al Señor con ungüento, y limpió sus pies con sus cabellos.)
Enviaron, pues, sus hermanas á él, diciendo: Señor, he aquí, el que amas está enfermo.
Y oyéndolo Jesús, dijo: Esta enfermedad no es para muerte, mas por gloria de Dios, para que el Hijo de Dios sea glorificado por ella.
Y amaba Jesús á Marta, y á su hermana, y á Lázaro.
Como oyó pues que estaba enfermo, quedóse aún dos días en aquel lugar donde estaba.
Luego, después de esto, dijo á los discípulos: Vamos á Judea otra vez.
Dícenle los discípulos: Rabbí, ahora procuraban los Judíos apedrearte, ¿y otra vez vas allá?
Respondió Jesús: ¿No tiene el día doce horas? El que anduviere de día, no tropieza, porque ve la luz de este mundo.
Mas el que anduviere de noche, tropieza, porque no hay luz en él.
Dicho esto, díceles después: Lázaro nuestro amigo duerme; mas voy á despertarle del sueño.
Dijeron entonces sus discípulos: Señor, si duerme, salvo estará.
Mas esto decía Jesús de la muerte de él: y ellos pensaron que hablaba del reposar del sueño.
Entonces, pues, Jesús les dijo claramente: Lázaro es muerto;
Y huélgome por vosotros, que yo no haya estado allí, para que creáis: mas vamos á él.
Dijo entonces Tomás, el que se dice el Dídimo, á sus condiscípulos: Vamos también nosotros, para que muramos con él.
Vino pues Jesús, y halló que había ya cuatro días que estaba en el sepulcro.
Y Bethania estaba cerca de Jerusalem, como quince estadios;
Y muchos de los Judíos habían venido á Marta y á María, á consolarlas de su hermano.
Entonces Marta, como oyó que Jesús venía, salió á encontrarle; mas María se estuvo en casa.
Y Marta dijo á Jesús: Señor, si hubieses estado aquí, mi hermano no fuera muerto;
Mas también sé ahora, que todo lo que pidieres de Dios, te dará Dios.
Dícele Jesús: Resucitará tu hermano.
Marta le dice: Yo sé que resucitará en la resurrección en el día postrero.
Dícele Jesús: Yo soy la resurrección y la vida: el que cree en mí, aunque esté muerto, vivirá.
Y todo aquel que vive y cree en mí, no morirá eternamente. ¿Crees esto?
Dícele: Sí, Señor; yo he creído que tú eres el Cristo, el Hijo de Dios, que has venido al mundo.
Y esto dicho, fuése, y llamó en secreto á María su hermana, diciendo: El Maestro está aquí y te llama.
Ella, como lo oyó, levántase prestamente y viene á él.
(Que aun no había llegado Jesús á la aldea, mas estaba en aquel lugar donde Marta le había encontrado.)
Entonces los Judíos que estaban en casa con ella, y la consolaban, como vieron que María se había levantado prestamente, y había salido, siguiéronla, diciendo: Va al sepulcro á llorar allí.
Mas María, como vino donde estaba Jesús, viéndole, derribóse á sus pies, diciéndole: Señor, si hubieras estado aquí, no fuera muerto mi hermano.
Jesús entonces, como la vió llorando, y á los Judíos que habían venido juntamente con ella llorando, se conmovió en espíritu, y turbóse,
Y dijo: ¿Dónde le pusisteis? Dícenle: Señor, ven, y ve.
Y lloró Jesús.
Dijeron entonces los Judíos: Mirad cómo le amaba.
Y algunos de ellos dijeron: ¿No podía éste que abrió los ojos al ciego, hacer que éste no muriera?
Y Jesús, conmoviéndose otra vez en sí mismo, vino al sepulcro. Era una cueva, la cual tenía una piedra encima.
Dice Jesús: Quitad la piedra. Marta, la hermana del que se había muerto, le dice: Señor, hiede ya, que es de cuatro días.
Jesús le dice: ¿No te he dicho que, si creyeres, verás la gloria de Dios?
Entonces quitaron la piedra de donde el muerto había sido puesto. Y Jesús, alzando los ojos arriba, dijo: Padre, gracias te doy que me has oído.
Que yo sabía que siempre me oyes; mas por causa de la compañía que está alrededor, lo dije, para que crean que tú me has enviado.
Y habiendo dicho estas cosas, clamó á gran voz: Lázaro, ven fuera.
Y el que había estado muerto, salió, atadas las manos y los pies con vendas; y su rostro estaba envuelto en un sudario. Díceles Jesús: Desatadle, y dejadle ir.
Entonces muchos de los Judíos que habían venido á María, y habían visto lo que había hecho Jesús, creyeron en él.
Mas algunos de ellos fueron á los Fariseos, y dijéronles lo que Jesús había hecho.
Entonces los pontífices y los Fariseos juntaron concilio, y decían: ¿Qué hacemos? porque este hombre hace muchas señales.
Si le dejamos así, todos creerán en él: y vendrán los Romanos, y quitarán nuestro lugar y la nación.
Y Caifás, uno de ellos, sumo pontífice de aquel año, les dijo: Vosotros no sabéis nada;
Ni pensáis que nos conviene que un hombre muera por el pueblo, y no que toda la nación se pierda.
Mas esto no lo dijo de sí mismo; sino que, como era el sumo pontífice de aquel año, profetizó que Jesús había de morir por la nación:
Y no solamente por aquella nación, mas también para que juntase en uno los hijos de Dios que estaban derramados.
Así que, desde aquel día consultaban juntos de matarle.
Por tanto, Jesús ya no andaba manifiestamente entre los Judíos; mas fuése de allí á la tierra que está junto al desierto, á una ciudad que se llama Ephraim: y estábase allí con sus discípulos.
Y la Pascua de los Judíos estaba cerca: y muchos subieron de aquella tierra á Jerusalem antes de la Pascua, para purificarse;
Y buscaban á Jesús, y hablaban los unos con los otros estando en el templo: ¿Qué os parece, que no vendrá á la fiesta?
Y los pontífices y los Fariseos habían dado mandamiento, que si alguno supiese dónde estuviera, lo manifestase, para que le prendiesen.
Y JESÚS, seis días antes de la Pascua, vino á Bethania, donde estaba Lázaro, que había sido muerto, al cual había resucitado de los muertos.
E hiciéronle allí una cena: y Marta servía, y Lázaro era uno de los que estaban sentados á la mesa juntamente con él.
Entonces María tomó una libra de ungüento de nardo líquido de mucho precio, y ungió los pies de Jesús, y limpió sus pies con sus cabellos: y la casa se llenó del olor del ungüento.
Y dijo uno de sus discípulos, Judas Iscariote, hijode Simón, el que le había de entregar:
¿Por qué no se ha vendido este ungüento por trescientos dineros, y se dió á los pobres?
Mas dijo esto, no por el cuidado que él tenía de los pobres; sino porque era ladrón, y tenía la bolsa, y traía lo que se echaba en ella.
Entonces Jesús dijo: Déjala: para el día de mi sepultura ha guardado esto;
Porque á los pobres siempre los tenéis con vosotros, mas á mí no siempre me tenéis.
Entonces mucha gente de los Judíos entendió que él estaba allí; y vinieron no solamente por causa de Jesús, mas también por ver á Lázaro, al cual había resucitado de los muertos.
Consultaron asimismo los príncipes de los sacerdotes, de matar también á Lázaro;
Porque muchos de los Judíos iban y creían en Jesús por causa de él.
El siguiente día, mucha gente que había venido á la fiesta, como oyeron que Jesús venía á Jerusalem,
Tomaron ramos de palmas, y salieron á recibirle, y clamaban: ¡Hosanna, Bendito el que viene en el nombre del Señor, el Rey de Israel!
Y halló Jesús un asnillo, y se sentó sobre él, como está escrito:
No temas, hija de Sión: he aquí tu Rey viene, sentado sobre un pollino de asna.
Estas cosas no las entendieron sus discípulos de primero: empero cuando Jesús fué glorificado, entonces se acordaron de que estas cosas estaban escritas de él, y que le hicieron estas cosas.
Y la gente que estaba con él, daba testimonio de cuando llamó á Lázaro del sepulcro, y le resucitó de los muertos.
Por lo cual también había venido la gente á recibirle, porque había oído que él había hecho esta señal;
Mas los Fariseos dijeron entre sí: ¿Veis que nada aprovecháis? he aquí, el mundo se va tras de él.
Y había ciertos Griegos de los que habían subido á adorar en la fiesta:
Estos pues, se llegaron á Felipe, que era de Bethsaida de Galilea, y rogáronle, diciendo: Señor, querríamos ver á Jesús.
Vino Felipe, y díjolo á Andrés: Andrés entonces, y Felipe, lo dicen á Jesús.
Entonces Jesús les respondió, diciendo: La hora viene en que el Hijo del hombre ha de ser glorificado.
De cierto, de cierto os digo, que si el grano de trigo no cae en la tierra y muere, él solo queda; mas si muriere, mucho fruto lleva.
El que ama su vida, la perderá; y el que aborrece su vida en este mundo, para vida eterna la guardará.
Si alguno me sirve, sígame: y donde yo estuviere, allí también estará mi servidor. Si alguno me sirviere, mi Padre le honrará.
Ahora está turbada mi alma; ¿y qué diré? Padre, sálvame de esta hora. Mas por esto he venido en esta hora.
Padre, glorifica tu nombre. Entonces vino una voz del cielo: Y lo he glorificado, y lo glorificaré otra vez.
Y la gente que estaba presente, y había oído, decía que había sido trueno. Otros decían: Angel le ha hablado.
Respondió Jesús, y dijo: No ha venido esta voz por mi causa, mas por causa de vosotros.
Ahora es el juicio de este mundo: ahora el príncipe de este mundo será echado fuera.
Y yo, si fuere levantado de la tierra, á todos traeré á mí mismo.
Y esto decía dando á entender de qué muerte había de morir.
Respondióle la gente: Nosotros hemos oído de la ley, que el Cristo permanece para siempre: ¿cómo pues dices tú: Conviene que el Hijo del hombre sea levantado? ¿Quién es este Hijo del hombre?
Entonces Jesús les dice: Aun por un poco estará la luz entre vosotros: andad entre tanto que tenéis luz, porque no os sorprendan las tinieblas; porque el que anda en tinieblas, no sabe dónde va.
Entre tanto que tenéis la luz, creed en la luz, para que seáis hijos de luz. Estas cosas habló Jesús, y fuése, y escondióse de ellos.
Empero habiendo hecho delante de ellos tantas señales, no creían en él.
Para que se cumpliese el dicho que dijo el profeta Isaías: ¿Señor, quién ha creído á nuestro dicho? ¿y el brazo del Señor, á quién es revelado?
Por esto no podían creer, porque otra vez dijo Isaías:
Cegó los ojos de ellos, y endureció su corazón; porque no vean con los ojos, y entiendan de corazón, y se conviertan, y yo los sane.
Estas cosas dijo Isaías cuando vió su gloria, y habló de él.
Con todo eso, aun de los príncipes, muchos creyeron en él; mas por causa de los Fariseos no lo confesaban, por no ser echados de la sinagoga.
Porque amaban más la gloria de los hombres que la gloria de Dios.
Mas Jesús clamó y dijo: El que cree en mí, no cree en mí, sino en el que me envió;
Y el que me ve, ve al que me envió.
Yo la luz he venido al mundo, para que todo aquel que cree en mí no permanezca en tinieblas.
Y el que oyere mis palabras, y no las creyere, yo no le juzgo; porque no he venido á juzgar al mundo, sino á salvar al mundo.
El que me desecha, y no recibe mis palabras, tiene quien le juzgue: la palabra que he hablado, ella le juzgará en el día postrero.
Porque yo no he hablado de mí mismo: mas el Padre que me envió, él me dió mandamiento de lo que he de decir, y de lo que he de hablar.
Y sé que su mandamiento es vida eterna: así que, lo que yo hablo, como el Padre me lo ha dicho, así hablo.
ANTES de la fiesta de la Pascua, sabiendo Jesús que su hora había venido para que pasase de este mundo al Padre, como había amado á los suyos que estaban en el mundo, amólos hasta el fin.
Y la cena acabada, como el diablo ya había metido en el corazón de Judas, hijode Simón Iscariote, que le entregase,
Sabiendo Jesús que el Padre le había dado todas las cosas en las manos, y que había salido de Dios, y á Dios iba,
Levántase de la cena, y quítase su ropa, y tomando una toalla, ciñóse.
Luego puso agua en un lebrillo, y comenzó á lavar los pies de los discípulos, y á limpiarlos con la toalla con que estaba ceñido.
Entonces vino á Simón Pedro; y Pedro le dice: ¿Señor, tú me lavas los pies?
Respondió Jesús, y díjole: Lo que yo hago, tú no entiendes ahora; mas lo entenderás después.
Dícele Pedro: No me lavarás los pies jamás. Respondióle Jesús: Si no te lavare, no tendrás parte conmigo.
Dícele Simón Pedro: Señor, no sólo mis pies, mas aun las manos y la cabeza.
Dícele Jesús: El que está lavado, no necesita sino que lave los pies, mas está todo limpio: y vosotros limpios estáis, aunque no todos.
Porque sabía quién le había de entregar; por eso dijo: No estáis limpios todos.
Así que, después que les hubo lavado los pies, y tomado su ropa, volviéndose á sentar á la mesa, díjoles: ¿Sabéis lo que os he hecho?
Vosotros me llamáis, Maestro, y, Señor: y decís bien; porque lo soy.
Pues si yo, el Señor y el Maestro, he lavado vuestros pies, vosotros también debéis lavar los pies los unos á los otros.
Porque ejemplo os he dado, para que como yo os he hecho, vosotros también hagáis.
De cierto, de cierto os digo: El siervo no es mayor que su señor, ni el apóstol es mayor que el que le envió.
Si sabéis estas cosas, bienaventurados seréis, si las hiciereis.
No hablo de todos vosotros: yo sé los que he elegido: mas para que se cumpla la Escritura: El que come pan conmigo, levantó contra mí su calcañar.
Desde ahora os lo digo antes que se haga, para que cuando se hiciere, creáis que yo soy.
De cierto, de cierto os digo: El que recibe al que yo enviare, á mí recibe; y el que á mí recibe, recibe al que me envió.
Como hubo dicho Jesús esto, fué conmovido en el espíritu, y protestó, y dijo: De cierto, de cierto os digo, que uno de vosotros me ha de entregar.
Entonces los discípulos mirábanse los unos á los otros, dudando de quién decía.
Y uno de sus discípulos, al cual Jesús amaba, estaba recostado en el seno de Jesús.
A éste, pues, hizo señas Simón Pedro, para que preguntase quién era aquél de quien decía.
El entonces recostándose sobre el pecho de Jesús, dícele: Señor, ¿quién es?
Respondió Jesús: Aquél es, á quien yo diere el pan mojado. Y mojando el pan, diólo á Judas Iscariote, hijo de Simón.
Y tras el bocado Satanás entró en él. Entonces Jesús le dice: Lo que haces, hazlo más presto.
Mas ninguno de los que estaban á la mesa entendió á qué propósito le dijo esto.
Porque los unos pensaban, porque Judas tenía la bolsa, que Jesús le decía: Compra lo que necesitamos para la fiesta: ó, que diese algo á los pobres.
Como él pues hubo tomado el bocado, luego salió: y era ya noche.
Entonces como él salió, dijo Jesús: Ahora es glorificado el Hijo del hombre, y Dios es glorificado en él.
Si Dios es glorificado en él, Dios también le glorificará en sí mismo, y luego le glorificará.
Hijitos, aun un poco estoy con vosotros. Me buscaréis; mas, como dije á los Judíos: Donde yo voy, vosotros no podéis venir; así digo á vosotros ahora.
Un mandamiento nuevo os doy: Que os améis unos á otros: como os he amado, que también os améis los unos á los otros.
En esto conocerán todos que sois mis discípulos, si tuviereis amor los unos con los otros.
Dícele Simón Pedro: Señor, ¿adónde vas? Respondióle Jesús: Donde yo voy, no me puedes ahora seguir; mas me seguirás después.
Dícele Pedro: Señor, ¿por qué no te puedo seguir ahora? mi alma pondré por ti.
Respondióle Jesús: ¿Tu alma pondrás por mí? De cierto, de cierto te digo: No cantará el gallo, sin que me hayas negado tres veces.
NO se turbe vuestro corazón: creéis en Dios, creed también en mí.
En la casa de mi Padre muchas moradas hay: de otra manera oslohubiera dicho: voy, pues, á preparar lugar para vosotros.
Y si me fuere, y os aparejare lugar, vendré otra vez, y os tomaré á mí mismo: para que donde yo estoy, vosotros también estéis.
Y sabéis á dónde yo voy; y sabéis el camino.
Dícele Tomás: Señor, no sabemos á dónde vas: ¿cómo, pues, podemos saber el camino?
Jesús le dice: Yo soy el camino, y la verdad, y la vida: nadie viene al Padre, sino por mí.
Si me conocieseis, también á mi Padre conocierais: y desde ahora le conocéis, y le habéis visto.
Dícele Felipe: Señor, muéstranos el Padre, y nos basta.
Jesús le dice: ¿Tanto tiempo ha que estoy con vosotros, y no me has conocido, Felipe? El que me ha visto, ha visto al Padre; ¿cómo, pues, dices tú: Muéstranos el Padre?
¿No crees que yo soy en el Padre, y el Padre en mí? Las palabras que yo os hablo, no las hablo de mí mismo: mas el Padre que está en mí, él hace las obras.
Creedme que yo soy en el Padre, y el Padre en mí: de otra manera, creedme por las mismas obras.
De cierto, de cierto os digo: El que en mí cree, las obras que yo hago también él las hará; y mayores que éstas hará; porque yo voy al Padre.
Y todo lo que pidiereis al Padre en mi nombre, esto haré, para que el Padre sea glorificado en el Hijo.
Si algo pidiereis en mi nombre, yo lo haré.
Si me amáis, guardad mis mandamientos;
Y yo rogaré al Padre, y os dará otro Consolador, para que esté con vosotros para siempre:
Al Espíritu de verdad, al cual el mundo no puede recibir, porque no le ve, ni le conoce: mas vosotros le conocéis; porque está con vosotros, y será en vosotros.
No os dejaré huérfanos: vendré á vosotros.
Aun un poquito, y el mundo no me verá más; empero vosotros me veréis; porque yo vivo, y vosotros también viviréis.
En aquel día vosotros conoceréis que yo estoy en mi Padre, y vosotros en mí, y yo en vosotros.
El que tiene mis mandamientos, y los guarda, aquél es el que me ama; y el que me ama, será amado de mi Padre, y yo le amaré, y me manifestaré á él.
Dícele Judas, no el Iscariote: Señor, ¿qué hay porque te hayas de manifestar á nosotros, y no al mundo?
Respondió Jesús, y díjole: El que me ama, mi palabra guardará; y mi Padre le amará, y vendremos á él, y haremos con él morada.
El que no me ama, no guarda mis palabras: y la palabra que habéis oído, no es mía, sino del Padre que me envió.
Estas cosas os he hablado estando con vosotros.
Mas el Consolador, el Espíritu Santo, al cual el Padre enviará en mi nombre, él os enseñará todas las cosas, y os recordará todas las cosas que os he dicho.
La paz os dejo, mi paz os doy: no como el mundo la da, yo os la doy. No se turbe vuestro corazón, ni tenga miedo.
Habéis oído cómo yo os he dicho: Voy, y vengo á vosotros. Si me amaseis, ciertamente os gozaríais, porque he dicho que voy al Padre: porque el Padre mayor es que yo.
Y ahora os lo he dicho antes que se haga; para que cuando se hiciere, creáis.
Ya no hablaré mucho con vosotros: porque viene el príncipe de este mundo; mas no tiene nada en mí.
Empero para que conozca el mundo que amo al Padre, y como el Padre me dió el mandamiento, así hago. Levantaos, vamos de aquí.
YO soy la vid verdadera, y mi Padre es el labrador.
Todo pámpano que en mí no lleva fruto, le quitará: y todo aquel que lleva fruto, le limpiará, para que lleve más fruto.
Ya vosotros sois limpios por la palabra que os he hablado.
Estad en mí, y yo en vosotros. Como el pámpano no puede llevar fruto de sí mismo, si no estuviere en la vid; así ni vosotros, si no estuviereis en mí.
Yo soy la vid, vosotros los pámpanos: el que está en mí, y yo en él, éste lleva mucho fruto; porque sin mí nada podéis hacer.
El que en mí no estuviere, será echado fuera como mal pámpano, y se secará; y los cogen, y los echan en el fuego, y arden.
Si estuviereis en mí, y mis palabras estuvieren en vosotros, pedid todo lo que quisiereis, y os será hecho.
En esto es glorificado mi Padre, en que llevéis mucho fruto, y seáis así mis discípulos.
Como el Padre me amó, también yo os he amado: estad en mi amor.
Si guardareis mis mandamientos, estaréis en mi amor; como yo también he guardado los mandamientos de mi Padre, y estoy en su amor.
Estas cosas os he hablado, para que mi gozo esté en vosotros, y vuestro gozo sea cumplido.
Este es mi mandamiento: Que os améis los unos á los otros, como yo os he amado.
Nadie tiene mayor amor que este, que ponga alguno su vida por sus amigos.
Vosotros sois mis amigos, si hiciereis las cosas que yo os mando.
Ya no os llamaré siervos, porque el siervo no sabe lo que hace su señor: mas os he llamado amigos, porque todas las cosas que oí de mi Padre, os he hecho notorias.
Esto os mando: Que os améis los unos á los otros.
Si el mundo os aborrece, sabed que á mí me aborreció antes que á vosotros.
Si fuerais del mundo, el mundo amaría lo suyo; mas porque no sois del mundo, antes yo os elegí del mundo, por eso os aborrece el mundo.
Acordaos de la palabra que yo os he dicho: No es el siervo mayor que su señor. Si á mí me han perseguido, también á vosotros perseguirán: si han guardado mi palabra, también guardarán la vuestra.
Mas todo esto os harán por causa de mi nombre, porque no conocen al que me ha enviado.
Si no hubiera venido, ni les hubiera hablado, no tendrían pecado, mas ahora no tienen excusa de su pecado.
El que me aborrece, también á mi Padre aborrece.
Si no hubiese hecho entre ellos obras cuales ningún otro ha hecho, no tendrían pecado; mas ahora, y las han visto, y me aborrecen á mí y á mi Padre.
Mas para que se cumpla la palabra que está escrita en su ley: Que sin causa me aborrecieron.
Empero cuando viniere el Consolador, el cual yo os enviaré del Padre, el Espíritu de verdad, el cual procede del Padre, él dará testimonio de mí.
Y vosotros daréis testimonio, porque estáis conmigo desde el principio.
ESTAS cosas os he hablado, para que no os escandalicéis.
Os echarán de las sinagogas; y aun viene la hora, cuando cualquiera que os matare, pensará que hace servicio á Dios.
Y estas cosas os harán, porque no conocen al Padre ni á mí.
Mas os he dicho esto, para que cuando aquella hora viniere, os acordéis que yo os lo había dicho. Esto empero no os lo dije al principio, porque yo estaba con vosotros.
Mas ahora voy al que me envió; y ninguno de vosotros me pregunta: ¿Adónde vas?
Antes, porque os he hablado estas cosas, tristeza ha henchido vuestro corazón.
Empero yo os digo la verdad: Os es necesario que yo vaya: porque si yo no fuese, el Consolador no vendría á vosotros; mas si yo fuere, os le enviaré.
Y cuando él viniere redargüirá al mundo de pecado, y de justicia, y de juicio:
De pecado ciertamente, por cuanto no creen en mí;
Y de justicia, por cuanto voy al Padre, y no me veréis más;
Y de juicio, por cuanto el príncipe de este mundo es juzgado.
Aun tengo muchas cosas que deciros, mas ahora no las podéis llevar.
El me glorificará: porque tomará de lo mío, y os lo hará saber.
Todo lo que tiene el Padre, mío es: por eso dije que tomará de lo mío, y os lo hará saber.
Un poquito, y no me veréis; y otra vez un poquito, y me veréis: porque yo voy al Padre.
Decían pues: ¿Qué es esto que dice: Un poquito? No entendemos lo que habla.
De cierto, de cierto os digo, que vosotros lloraréis y lamentaréis, y el mundo se alegrará: empero aunque vosotros estaréis tristes, vuestra tristeza se tornará en gozo.
También, pues, vosotros ahora ciertamente tenéis tristeza; mas otra vez os veré, y se gozará vuestro corazón, y nadie quitará de vosotros vuestro gozo.
Y aquel día no me preguntaréis nada. De cierto, de cierto os digo, que todo cuanto pidiereis al Padre en mi nombre, os lo dará.
Hasta ahora nada habéis pedido en mi nombre: pedid, y recibiréis, para que vuestro gozo sea cumplido.
Estas cosas os he hablado en proverbios: la hora viene cuando ya no os hablaré por proverbios, pero claramente os anunciaré del Padre.
Aquel día pediréis en mi nombre: y no os digo, que yo rogaré al Padre por vosotros;
Pues el mismo Padre os ama, porque vosotros me amasteis, y habéis creído que yo salí de Dios.
Salí del Padre, y he venido al mundo: otra vez dejo el mundo, y voy al Padre.
Dícenle sus discípulos: He aquí, ahora hablas claramente, y ningún proverbio dices.
Ahora entendemos que sabes todas las cosas, y no necesitas que nadie te pregunte: en esto creemos que has salido de Dios.
Respondióles Jesús: ¿Ahora creéis?
He aquí, la hora viene, y ha venido, que seréis esparcidos cada uno por su parte, y me dejaréis solo: mas no estoy solo, porque el Padre está conmigo.
Estas cosas os he hablado, para que en mí tengáis paz. En el mundo tendréis aflicción: mas confiad, yo he vencido al mundo.
ESTAS cosas habló Jesús, y levantados los ojos al cielo, dijo: Padre, la hora es llegada; glorifica á tu Hijo, para que también tu Hijo te glorifique á ti;
Como le has dado la potestad de toda carne, para que dé vida eterna á todos los que le diste.
Esta empero es la vida eterna: que te conozcan el solo Dios verdadero, y á Jesucristo, al cual has enviado.
Yo te he glorificado en la tierra: he acabado la obra que me diste que hiciese.
Ahora pues, Padre, glorifícame tú cerca de ti mismo con aquella gloria que tuve cerca de ti antes que el mundo fuese.
He manifestado tu nombre á los hombres que del mundo me diste: tuyos eran, y me los diste, y guardaron tu palabra.
Ahora han conocido que todas las cosas que me diste, son de ti;
Porque las palabras que me diste, les he dado; y ellos las recibieron, y han conocido verdaderamente que salí de ti, y han creído que tú me enviaste.
Yo ruego por ellos: no ruego por el mundo, sino por los que me diste; porque tuyos son:
Y todas mis cosas son tus cosas, y tus cosas son mis cosas: y he sido glorificado en ellas.
Y ya no estoy en el mundo; mas éstos están en el mundo, y yo á ti vengo. Padre santo, á los que me has dado, guárdalos por tu nombre, para que sean una cosa, como también nosotros.
Cuando estaba con ellos en el mundo, yo los guardaba en tu nombre; á los que me diste, yo los guardé, y ninguno de ellos se perdió, sino el hijo de perdición; para que la Escritura se cumpliese.
Mas ahora vengo á ti; y hablo esto en el mundo, para que tengan mi gozo cumplido en sí mismos.
Yo les he dado tu palabra; y el mundo los aborreció, porque no son del mundo, como tampoco yo soy del mundo.
No ruego que los quites del mundo, sino que los guardes del mal.
No son del mundo, como tampoco yo soy del mundo.
Santifícalos en tu verdad: tu palabra es verdad.
Como tú me enviaste al mundo, también los he enviado al mundo.
Y por ellos yo me santifico á mí mismo, para que también ellos sean santificados en verdad.
Mas no ruego solamente por éstos, sino también por los que han de creer en mí por la palabra de ellos.
Para que todos sean una cosa; como tú, oh Padre, en mí, y yo en ti, que también ellos sean en nosotros una cosa: para que el mundo crea que tú me enviaste.
Y yo, la gloria que me diste les he dado; para que sean una cosa, como también nosotros somos una cosa.
Yo en ellos, y tú en mí, para que sean consumadamente una cosa; que el mundo conozca que tú me enviaste, y que los has amado, como también á mí me has amado.
Padre, aquellos que me has dado, quiero que donde yo estoy, ellos estén también conmigo; para que vean mi gloria que me has dado: por cuanto me has amado desde antes de la constitución del mundo.
Padre justo, el mundo no te ha conocido, mas yo te he conocido; y éstos han conocido que tú me enviaste;
Y yo les he manifestado tu nombre, y manifestarélo aún; para que el amor con que me has amado, esté en ellos, y yo en ellos.
COMO Jesús hubo dicho estas cosas, salióse con sus discípulos tras el arroyo de Cedrón, donde estaba un huerto, en el cual entró Jesús y sus discípulos.
Y también Judas, el que le entregaba, sabía aquel lugar; porque muchas veces Jesús se juntaba allí con sus discípulos.
Judas pues tomando una compañía, y ministros de los pontífices y de los Fariseos, vino allí con linternas y antorchas, y con armas.
Empero Jesús, sabiendo todas las cosas que habían de venir sobre él, salió delante, y díjoles: ¿A quién buscáis?
Respondiéronle: A Jesús Nazareno. Díceles Jesús: Yo soy. (Y estaba también con ellos Judas, el que le entregaba.)
Y como les dijo, Yo soy, volvieron atrás, y cayeron en tierra.
Volvióles, pues, á preguntar: ¿A quién buscáis? Y ellos dijeron: A Jesús Nazareno.
Respondió Jesús: Os he dicho que yo soy: pues si á mí buscáis, dejad ir á éstos.
Para que se cumpliese la palabra que había dicho: De los que me diste, ninguno de ellos perdí.
Entonces Simón Pedro, que tenía espada, sacóla, é hirió al siervo del pontífice, y le cortó la oreja derecha. Y el siervo se llamaba Malco.
Jesús entonces dijo á Pedro: Mete tu espada en la vaina: el vaso que el Padre me ha dado, ¿no lo tengo de beber?
Entonces la compañía y el tribuno, y los ministros de los Judíos, prendieron á Jesús y le ataron,
Y lleváronle primeramente á Anás; porque era suegro de Caifás, el cual era pontífice de aquel año.
Y era Caifás el que había dado el consejo á los Judíos, que era necesario que un hombre muriese por el pueblo.
Y seguía á Jesús Simón Pedro, y otro discípulo. Y aquel discípulo era conocido del pontífice, y entró con Jesús al atrio del pontífice;
Mas Pedro estaba fuera á la puerta. Y salió aquel discípulo que era conocido del pontífice, y habló á la portera, y metió dentro á Pedro.
Entonces la criada portera dijo á Pedro: ¿No eres tú también de los discípulos de este hombre? Dice él: No soy.
Y estaban en pie los siervos y los ministros que habían allegado las ascuas; porque hacía frío, y calentábanse: y estaba también con ellos Pedro en pie, calentándose.
Y el pontífice preguntó á Jesús acerca de sus discípulos y de su doctrina.
Jesús le respondió: Yo manifiestamente he hablado al mundo: yo siempre he enseñado en la sinagoga y en el templo, donde se juntan todos los Judíos, y nada he hablado en oculto.
¿Qué me preguntas á mí? Pregunta á los que han oído, qué les haya yo hablado: he aquí, ésos saben lo que yo he dicho.
Y como él hubo dicho esto, uno de los criados que estaba allí, dió una bofetada á Jesús, diciendo: ¿Así respondes al pontífice?
Respondióle Jesús: Si he hablado mal, da testimonio del mal: y si bien, ¿por qué me hieres?
Y Anás le había enviado atado á Caifás pontífice.
Estaba pues Pedro en pie calentándose. Y dijéronle: ¿No eres tú de sus discípulos? El negó, y dijo: No soy.
Uno de los siervos del pontífice, pariente de aquél á quien Pedro había cortado la oreja, le dice: ¿No te vi yo en el huerto con él?
Y negó Pedro otra vez: y luego el gallo cantó.
Y llevaron á Jesús de Caifás al pretorio: y era por la mañana: y ellos no entraron en el pretorio por no ser contaminados, sino que comiesen la pascua.
Entonces salió Pilato á ellos fuera, y dijo: ¿Qué acusación traéis contra este hombre?
Respondieron y dijéronle: Si éste no fuera malhechor, no te le habríamos entregado.
Díceles entonces Pilato: Tomadle vosotros, y juzgadle según vuestra ley. Y los Judíos le dijeron: A nosotros no es lícito matar á nadie:
Para que se cumpliese el dicho de Jesús, que había dicho, dando á entender de qué muerte había de morir.
Así que, Pilato volvió á entrar en el pretorio, y llamó á Jesús, y díjole: ¿Eres tú el Rey de los Judíos?
Respondióle Jesús: ¿Dices tú esto de ti mismo, ó te lo han dicho otros de mí?
Pilato respondió: ¿Soy yo Judío? Tu gente, y los pontífices, te han entregado á mí: ¿qué has hecho?
Respondió Jesús: Mi reino no es de este mundo: si de este mundo fuera mi reino, mis servidores pelearían para que yo no fuera entregado á los Judíos: ahora, pues, mi reino no es de aquí.
Dícele Pilato: ¿Qué cosa es verdad? Y como hubo dicho esto, salió otra vez á los Judíos, y díceles: Yo no hallo en él ningún crimen.
Empero vosotros tenéis costumbre, que os suelte uno en la Pascua: ¿queréis, pues, que os suelte al Rey de los Judíos?
Entonces todos dieron voces otra vez, diciendo: No á éste, sino á Barrabás. Y Barrabás era ladrón.
ASÍ que, entonces tomó Pilato á Jesús, y le azotó.
Y los soldados entretejieron de espinas una corona, y pusiéronla sobre su cabeza, y le vistieron de una ropa de grana;
Y decían: ¡Salve, Rey de los Judíos! y dábanle de bofetadas.
Entonces Pilato salió otra vez fuera, y díjoles: He aquí, os le traigo fuera, para que entendáis que ningún crimen hallo en él.
Y salió Jesús fuera, llevando la corona de espinas y la ropa de grana. Y díceles Pilato: He aquí el hombre.
Respondiéronle los Judíos: Nosotros tenemos ley, y según nuestra ley debe morir, porque se hizo Hijo de Dios.
Y como Pilato oyó esta palabra, tuvo más miedo.
Y entró otra vez en el pretorio, y dijo á Jesús: ¿De dónde eres tú? Mas Jesús no le dió respuesta.
Entonces dícele Pilato: ¿A mí no me hablas? ¿no sabes que tengo potestad para crucificarte, y que tengo potestad para soltarte?
Respondió Jesús: Ninguna potestad tendrías contra mí, si no te fuese dado de arriba: por tanto, el que á ti me ha entregado, mayor pecado tiene.
Desde entonces procuraba Pilato soltarle; mas los Judíos daban voces, diciendo: Si á éste sueltas, no eres amigo de César: cualquiera que se hace rey, á César contradice.
Entonces Pilato, oyendo este dicho, llevó fuera á Jesús, y se sentó en el tribunal en el lugar que se dice Lithóstrotos, y en hebreo Gabbatha.
Y era la víspera de la Pascua, y como la hora de sexta. Entonces dijo á los Judíos: He aquí vuestro Rey.
Mas ellos dieron voces: Quita, quita, crucifícale. Díceles Pilato: ¿A vuestro Rey he de crucificar? Respondieron los pontífices: No tenemos rey sino á César.
Así que entonces lo entregó á ellos para que fuese crucificado. Y tomaron á Jesús, y le llevaron.
Y llevando su cruz, salió al lugar que se dice de la Calavera, y en hebreo, Gólgotha;
Donde le crucificaron, y con él otros dos, uno á cada lado, y Jesús en medio.
Y escribió también Pilato un título, que puso encima de la cruz. Y el escrito era: JESUS NAZARENO, REY DE LOS JUDIOS.
Y muchos de los Judíos leyeron este título: porque el lugar donde estaba crucificado Jesús era cerca de la ciudad: y estaba escrito en hebreo, en griego, y en latín.
Y decían á Pilato los pontífices de los Judíos: No escribas, Rey de los Judíos: sino, que él dijo: Rey soy de los Judíos.
Respondió Pilato: Lo que he escrito, he escrito.
Y como los soldados hubieron crucificado á Jesús, tomaron sus vestidos, é hicieron cuatro partes (para cada soldado una parte); y la túnica; mas la túnica era sin costura, toda tejida desde arriba.
Y estaban junto á la cruz de Jesús su madre, y la hermana de su madre, María mujer de Cleofas, y María Magdalena.
Y como vió Jesús á la madre, y al discípulo que él amaba, que estaba presente, dice á su madre: Mujer, he ahí tu hijo.
Después dice al discípulo: He ahí tu madre. Y desde aquella hora el discípulo la recibió consigo.
Después de esto, sabiendo Jesús que todas las cosas eran ya cumplidas, para que la Escritura se cumpliese, dijo: Sed tengo.
Y estaba allí un vaso lleno de vinagre: entonces ellos hinchieron una esponja de vinagre, y rodeada á un hisopo, se la llegaron á la boca.
Y como Jesús tomó el vinagre, dijo: Consumado es. Y habiendo inclinado la cabeza, dió el espíritu.
Y vinieron los soldados, y quebraron las piernas al primero, y asimismo al otro que había sido crucificado con él.
Mas cuando vinieron á Jesús, como le vieron ya muerto, no le quebraron las piernas:
Empero uno de los soldados le abrió el costado con una lanza, y luego salió sangre y agua.
Y el que lo vió, da testimonio, y su testimonio es verdadero: y él sabe que dice verdad, para que vosotros también creáis.
Porque estas cosas fueron hechas para que se cumpliese la Escritura: Hueso no quebrantaréis de él.
Y también otra Escritura dice: Mirarán al que traspasaron.
Y vino también Nicodemo, el que antes había venido á Jesús de noche, trayendo un compuesto de mirra y de áloes, como cien libras.
Tomaron pues el cuerpo de Jesús, y envolviéronlo en lienzos con especias, como es costumbre de los Judíos sepultar.
Y en aquel lugar donde había sido crucificado, había un huerto; y en el huerto un sepulcro nuevo, en el cual aun no había sido puesto ninguno.
Allí, pues, por causa de la víspera de la Pascua de los Judíos, porque aquel sepulcro estaba cerca, pusieron á Jesús.
Y EL primerdíade la semana, María Magdalena vino de mañana, siendo aún obscuro, al sepulcro; y vió la piedra quitada del sepulcro.
Entonces corrió, y vino á Simón Pedro, y al otro discípulo, al cual amaba Jesús, y les dice: Han llevado al Señor del sepulcro, y no sabemos dónde le han puesto.
Y salió Pedro, y el otro discípulo, y vinieron al sepulcro.
Y corrían los dos juntos; mas el otro discípulo corrió más presto que Pedro, y llegó primero al sepulcro.
Y bajándose á mirar, vió los lienzos echados; mas no entró.
Llegó luego Simón Pedro siguiéndole, y entró en el sepulcro, y vió los lienzos echados,
Y el sudario, que había estado sobre su cabeza, no puesto con los lienzos, sino envuelto en un lugar aparte.
Y entonces entró también el otro discípulo, que había venido primero al sepulcro, y vió, y creyó.
Porque aun no sabían la Escritura, que era necesario que él resucitase de los muertos.
Y volvieron los discípulos á los suyos.
Empero María estaba fuera llorando junto al sepulcro: y estando llorando, bajóse á mirar el sepulcro;
Y vió dos ángeles en ropas blancas que estaban sentados, el uno á la cabecera, y el otro á los pies, donde el cuerpo de Jesús había sido puesto.
Y dijéronle: Mujer, ¿por qué lloras? Díceles: Porque se han llevado á mi Señor, y no sé dónde le han puesto.
Y como hubo dicho esto, volvióse atrás, y vió á Jesús que estaba allí; mas no sabía que era Jesús.
Dícele Jesús: ¡María! Volviéndose ella, dícele: ¡Rabboni! que quiere decir, Maestro.
Dícele Jesús: No me toques: porque aun no he subido á mi Padre: mas ve á mis hermanos, y diles: Subo á mi Padre y á vuestro Padre, á mi Dios y á vuestro Dios.
Fué María Magdalena dando las nuevas á los discípulos de que había visto al Señor, y que él le había dicho estas cosas.
Y como hubo dicho esto, mostróles las manos y el costado. Y los discípulos se gozaron viendo al Señor.
Entonces les dijo Jesús otra vez: Paz á vosotros; como me envió el Padre, así también yo os envío.
Y como hubo dicho esto, sopló, y díjoles: Tomad el Espíritu Santo:
A los que remitiereis los pecados, les son remitidos: á quienes los retuviereis, serán retenidos.
Empero Tomás, uno de los doce, que se dice el Dídimo, no estaba con ellos cuando Jesús vino.
Y ocho días después, estaban otra vez sus discípulos dentro, y con ellos Tomás. Vino Jesús, las puertas cerradas, y púsose en medio, y dijo: Paz á vosotros.
Luego dice á Tomás: Mete tu dedo aquí, y ve mis manos: y alarga acá tu mano, y métela en mi costado: y no seas incrédulo, sino fiel.
Entonces Tomás respondió, y díjole: ¡Señor mío, y Dios mío!
Dícele Jesús: Porque me has visto, Tomás, creiste: bienaventurados los que no vieron y creyeron.
Y también hizo Jesús muchas otras señales en presencia de sus discípulos, que no están escritas en este libro.
Estas empero son escritas, para que creáis que Jesús es el Cristo, el Hijo de Dios; y para que creyendo, tengáis vida en su nombre.
DESPUÉS se manifestó Jesús otra vez á sus discípulos en la mar de Tiberias; y manifestóse de esta manera.
Estaban juntos Simón Pedro, y Tomás, llamado el Dídimo, y Natanael, el que era de Caná de Galilea, y los hijos de Zebedeo, y otros dos de sus discípulos.
Díceles Simón: A pescar voy. Dícenle: Vamos nosotros también contigo. Fueron, y subieron en una barca; y aquella noche no cogieron nada.
Y venida la mañana, Jesús se puso á la ribera: mas los discípulos no entendieron que era Jesús.
Y díjoles: Mozos, ¿tenéis algo de comer? Respondiéronle: No.
Y él les dice: Echad la red á la mano derecha del barco, y hallaréis. Entonces la echaron, y no la podían en ninguna manera sacar, por la multitud de los peces.
Y los otros discípulos vinieron con el barco (porque no estaban lejos de tierra sino como doscientos codos), trayendo la red de peces.
Y como descendieron á tierra, vieron ascuas puestas, y un pez encima de ellas, y pan.
Díceles Jesús: Traed de los peces que cogisteis ahora.
Subió Simón Pedro, y trajo la red á tierra, llena de grandes peces, ciento cincuenta y tres: y siendo tantos, la red no se rompió.
Díceles Jesús: Venid, comed. Y ninguno de los discípulos osaba preguntarle: ¿Tú, quién eres? sabiendo que era el Señor.
Viene pues Jesús, y toma el pan, y les da; y asimismo del pez.
Esta era ya la tercera vez que Jesús se manifestó á sus discípulos, habiendo resucitado de los muertos.
Vuélvele á decir la segunda vez: Simón, hijo de Jonás, ¿me amas? Respóndele: Sí, Señor: tú sabes que te amo. Dícele: Apacienta mis ovejas.
Y esto dijo, dando á entender con qué muerte había de glorificar á Dios. Y dicho esto, dícele: Sígueme.
Volviéndose Pedro, ve á aquel discípulo al cual amaba Jesús, que seguía, el que también se había recostado á su pecho en la cena, y le había dicho: Señor, ¿quién es el que te ha de entregar?
Así que Pedro vió á éste, dice á Jesús: Señor, ¿y éste, qué?
Dícele Jesús: Si quiero que él quede hasta que yo venga, ¿qué á tí? Sígueme tú.
Salió entonces este dicho entre los hermanos, que aquel discípulo no había de morir. Mas Jesús no le dijo, No morirá; sino: Si quiero que él quede hasta que yo venga ¿qué á ti?
Este es aquel discípulo que da testimonio de estas cosas, y escribió estas cosas: y sabemos que su testimonio es verdadero.
Y hay también otras muchas cosas que hizo Jesús, que si se escribiesen cada una por sí, ni aun en el mundo pienso que cabrían los libros que se habrían de escribir. Amén.
EN el primer tratado, oh Teófilo, he hablado de todas las cosas que Jesús comenzó á hacer y á enseñar,
Hasta el día en que, habiendo dado mandamientos por el Espíritu Santo á los apóstoles que escogió, fué recibido arriba;
A los cuales, después de haber padecido, se presentó vivo con muchas pruebas indubitables, apareciéndoles por cuarenta días, y hablándoles del reino de Dios.
Y estando juntos, les mandó que no se fuesen de Jerusalem, sino que esperasen la promesa del Padre, que oísteis, dijo, de mí.
Porque Juan á la verdad bautizó con agua, mas vosotros seréis bautizados con el Espíritu Santo no muchos días después de estos.
Entonces los que se habían juntado le preguntaron, diciendo: Señor, ¿restituirás el reino á Israel en este tiempo?
Y les dijo: No toca á vosotros saber los tiempos ó las sazones que el Padre puso en su sola potestad;
Mas recibiréis la virtud del Espíritu Santo que vendrá sobre vosotros; y me sereís testigos en Jerusalem, y en toda Judea, y Samaria, y hasta lo último de la tierra.
Y habiendo dicho estas cosas, viéndolo ellos, fué alzado; y una nube le recibió y le quitó de sus ojos.
Y estando con los ojos puestos en el cielo, entre tanto que él iba, he aquí dos varones se pusieron junto á ellos en vestidos blancos;
Los cuales también les dijeron: Varones Galileos, ¿qué estáis mirando al cielo? este mismo Jesús que ha sido tomado desde vosotros arriba en el cielo, así vendrá como le habéis visto ir al cielo.
Entonces se volvieron á Jerusalem del monte que se llama del Olivar, el cual está cerca de Jerusalem camino de un sábado.
Todos éstos perseveraban unánimes en oración y ruego, con las mujeres, y con María la madre de Jesús, y con sus hermanos.
Y en aquellos días, Pedro, levantándose en medio de los hermanos, dijo (y era la compañía junta como de ciento y veinte en número):
Varones hermanos, convino que se cumpliese la Escritura, la cual dijo antes el Espíritu Santo por la boca de David, de Judas, que fué guía de los que prendieron á Jesús;
El cuál era contado con nosotros, y tenía suerte en este ministerio.
Este, pues, adquirió un campo del salario de su iniquidad, y colgándose, reventó por medio, y todas sus entrañas se derramaron.
Y fué notorio á todos los moradores de Jerusalem; de tal manera que aquel campo es llamado en su propia lengua, Acéldama, que es, Campo de sangre.
Porque está escrito en el libro de los salmos: Sea hecha desierta su habitación, y no haya quien more en ella; y: Tome otro su obispado.
Conviene, pues, que de estos hombres que han estado juntos con nosotros todo el tiempo que el Señor Jesús entró y salió entre nosotros,
Comenzando desde el bautismo de Juan, hasta el día que fué recibido arriba de entre nosotros, uno sea hecho testigo con nosotros de su resurrección.
Y señalaron á dos: á José, llamado Barsabas, que tenía por sobrenombre Justo, y á Matías.
Y orando, dijeron: Tú, Señor, que conoces los corazones de todos, muestra cuál escoges de estos dos,
Para que tome el oficio de este ministerio y apostolado, del cual cayó Judas por transgresión, para irse á su lugar.
Y les echaron suertes, y cayó la suerte sobre Matías; y fué contado con los once apóstoles.
Y COMO se cumplieron los días de Pentecostés, estaban todos unánimes juntos;
Y de repente vino un estruendo del cielo como de un viento recio que corría, el cual hinchió toda la casa donde estaban sentados;
Y se les aparecieron lenguas repartidas, como de fuego, que se asentó sobre cada uno de ellos.
Y fueron todos llenos del Espíritu Santo, y comenzaron á hablar en otras lenguas, como el Espíritu les daba que hablasen.
Moraban entonces en Jerusalem Judíos, varones religiosos, de todas las naciones debajo del cielo.
Y hecho este estruendo, juntóse la multitud; y estaban confusos, porque cada uno les oía hablar su propia lengua.
Y estaban atónitos y maravillados, diciendo: He aquí ¿no son Galileos todos estos que hablan?
¿Cómo, pues, les oímos nosotros hablar cada uno en nuestra lengua en que somos nacidos?
Partos y Medos, y Elamitas, y los que habitamos en Mesopotamia, en Judea y en Capadocia, en el Ponto y en Asia,
En Phrygia y Pamphylia, en Egipto y en las partes de Africa que está de la otra parte de Cirene, y Romanos extranjeros, tanto Judíos como convertidos,
Cretenses y Arabes, les oímos hablar en nuestras lenguas las maravillas de Dios.
Y estaban todos atónitos y perplejos, diciendo los unos á los otros: ¿Qué quiere ser esto?
Mas otros burlándose, decían: Que están llenos de mosto.
Entonces Pedro, poniéndose en pie con los once, alzó su voz, y hablóles diciendo: Varones Judíos, y todos los que habitáis en Jerusalem, esto os sea notorio, y oid mis palabras.
Porque éstos no están borrachos, como vosotros pensáis, siendo la hora tercia del día;
Mas esto es lo que fué dicho por el profeta Joel:
Y de cierto sobre mis siervos y sobre mis siervas en aquellos días derramaré de mi Espíritu, y profetizarán.
Y daré prodigios arriba en el cielo, y señales abajo en la tierra, sangre y fuego y vapor de humo:
El sol se volverá en tinieblas, y la luna en sangre, antes que venga el día del Señor, grande y manifiesto;
Y será que todo aquel que invocare el nombre del Señor, será salvo.
A éste, entregado por determinado consejo y providencia de Dios, prendisteis y matasteis por manos de los inicuos, crucificándole;
Al cual Dios levantó, sueltos los dolores de la muerte, por cuanto era imposible ser detenido de ella.
Porque David dice de él: Veía al Señor siempre delante de mí: porque está á mi diestra, no seré conmovido.
Por lo cual mi corazón se alegró, y gozóse mi lengua; y aun mi carne descansará en esperanza;
Que no dejarás mi alma en el infierno, ni darás á tu Santo que vea corrupción.
Hicísteme notorios los caminos de la vida; me henchirás de gozo con tu presencia.
Varones hermanos, se os puede libremente decir del patriarca David, que murió, y fué sepultado, y su sepulcro está con nosotros hasta del día de hoy.
Empero siendo profeta, y sabiendo que con juramento le había Dios jurado que del fruto de su lomo, cuanto á la carne, levantaría al Cristo que se sentaría sobre su trono;
Viéndolo antes, habló de la resurrección de Cristo, que su alma no fué dejada en el infierno, ni su carne vió corrupción.
A este Jesús resucitó Dios, de lo cual todos nosotros somos testigos.
Así que, levantado por la diestra de Dios, y recibiendo del Padre la promesa del Espíritu Santo, ha derramado esto que vosotros veis y oís.
Porque David no subió á los cielos; empero él dice: Dijo el Señor á mi Señor: Siéntate á mi diestra,
Hasta que ponga á tus enemigos por estrado de tus pies.
Sepa pues ciertísimamente toda la casa de Israel, que á éste Jesús que vosotros crucificasteis, Dios ha hecho Señor y Cristo.
Entonces oído esto, fueron compungidos de corazón, y dijeron á Pedro y á los otros apóstoles: Varones hermanos, ¿qué haremos?
Y Pedro les dice: Arrepentíos, y bautícese cada uno de vosotros en el nombre de Jesucristo para perdón de los pecados; y recibiréis el don del Espíritu Santo.
Porque para vosotros es la promesa, y para vuestros hijos, y para todos los que están lejos; para cuantos el Señor nuestro Dios llamare.
Y con otras muchas palabras testificaba y exhortaba, diciendo: Sed salvos de esta perversa generación.
Así que, los que recibieron su palabra, fueron bautizados: y fueron añadidas á ellos aquel día como tres mil personas.
Y perseveraban en la doctrina de los apóstoles, y en la comunión, y en el partimiento del pan, y en las oraciones.
Y toda persona tenía temor: y muchas maravillas y señales eran hechas por los apóstoles.
Y todos los que creían estaban juntos; y tenían todas las cosas comunes;
Y vendían las posesiones, y las haciendas, y repartíanlas á todos, como cada uno había menester.
Y perseverando unánimes cada día en el templo, y partiendo el pan en las casas, comían juntos con alegría y con sencillez de corazón,
Alabando á Dios, y teniendo gracia con todo el pueblo. Y el Señor añadía cada día á la iglesia los que habían de ser salvos.
PEDRO y Juan subían juntos al templo á la hora de oración, la de nona.
Este, como vió á Pedro y á Juan que iban á entrar en el templo, rogaba que le diesen limosna.
Y Pedro, con Juan, fijando los ojos en él, dijo: Mira á nosotros.
Entonces él estuvo atento á ellos, esperando recibir de ellos algo.
Y Pedro dijo: Ni tengo plata ni oro; mas lo que tengo te doy: en el nombre de Jesucristo de Nazaret, levántate y anda.
Y tomándole por la mano derecha le levantó: y luego fueron afirmados sus pies y tobillos;
Y saltando, se puso en pie, y anduvo; y entró con ellos en el templo, andando, y saltando, y alabando á Dios.
Y todo el pueblo le vió andar y alabar á Dios.
Y conocían que él era el que se sentaba á la limosna á la puerta del templo, la Hermosa: y fueron llenos de asombro y de espanto por lo que le había acontecido.
Y teniendo á Pedro y á Juan el cojo que había sido sanado, todo el pueblo concurrió á ellos al pórtico que se llama de Salomón, atónitos.
Mas vosotros al Santo y al Justo negasteis, y pedisteis que se os diese un homicida;
Y matasteis al Autor de la vida, al cual Dios ha resucitado de los muertos; de lo que nosotros somos testigos.
Y en la fe de su nombre, á éste que vosotros veis y conocéis, ha confirmado su nombre: y la fe que por él es, ha dado á éste esta completa sanidad en presencia de todos vosotros.
Mas ahora, hermanos, sé que por ignorancia lo habéis hecho, como también vuestros príncipes.
Empero Dios ha cumplido así lo que había antes anunciado por boca de todos sus profetas, que su Cristo había de padecer.
Así que, arrepentíos y convertíos, para que sean borrados vuestros pecados; pues que vendrán los tiempos del refrigerio de la presencia del Señor,
Y enviará á Jesucristo, que os fué antes anunciado:
Al cual de cierto es menester que el cielo tenga hasta los tiempos de la restauración de todas las cosas, que habló Dios por boca de sus santos profetas que han sido desde el siglo.
Porque Moisés dijo á los padres: El Señor vuestro Dios os levantará profeta de vuestros hermanos, como yo; á él oiréis en todas las cosas que os hablare.
Y será, que cualquiera alma que no oyere á aquel profeta, será desarraigada del pueblo.
Y todos los profetas desde Samuel y en adelante, todos los que han hablado, han anunciado estos días.
Vosotros sois los hijos de los profetas, y del pacto que Dios concertó con nuestros padres, diciendo á Abraham: Y en tu simiente serán benditas todas las familias de la tierra.
A vosotros primeramente, Dios, habiendo levantado á su Hijo, le envió para que os bendijese, á fin de que cada uno se convierta de su maldad.
Y HABLANDO ellos al pueblo, sobrevinieron los sacerdotes, y el magistrado del templo, y los Saduceos,
Resentidos de que enseñasen al pueblo, y anunciasen en Jesús la resurrección de los muertos.
Y les echaron mano, y los pusieron en la cárcel hasta el día siguiente; porque era ya tarde.
Mas muchos de los que habían oído la palabra, creyeron; y fué el número de los varones como cinco mil.
Y aconteció al día siguiente, que se juntaron en Jerusalem los príncipes de ellos, y los ancianos, y los escribas;
Y Anás, príncipe de los sacerdotes, y Caifás, y Juan y Alejandro, y todos los que eran del linaje sacerdotal;
Y haciéndolos presentar en medio, les preguntaron: ¿Con qué potestad, ó en qué nombre, habéis hecho vosotros esto?
Entonces Pedro, lleno del Espíritu Santo, les dijo: Príncipes del pueblo, y ancianos de Israel:
Pues que somos hoy demandados acerca del beneficio hecho á un hombre enfermo, de qué manera éste haya sido sanado,
Este es la piedra reprobada de vosotros los edificadores, la cual es puesta por cabeza del ángulo.
Y en ningún otro hay salud; porque no hay otro nombre debajo del cielo, dado á los hombres, en que podamos ser salvos.
Entonces viendo la constancia de Pedro y de Juan, sabido que eran hombres sin letras é ignorantes, se maravillaban; y les conocían que habían estado con Jesús.
Y viendo al hombre que había sido sanado, que estaba con ellos, no podían decir nada en contra.
Mas les mandaron que se saliesen fuera del concilio; y conferían entre sí,
Diciendo: ¿Qué hemos de hacer á estos hombres? porque de cierto, señal manifiesta ha sido hecha por ellos, notoria á todos los que moran en Jerusalem, y no lo podemos negar.
Todavía, porque no se divulgue más por el pueblo, amenacémoslos que no hablen de aquí adelante á hombre alguno en este nombre.
Y llamándolos, les intimaron que en ninguna manera hablasen ni enseñasen en el nombre de Jesús.
Entonces Pedro y Juan, respondiendo, les dijeron: Juzgad si es justo delante de Dios obedecer antes á vosotros que á Dios:
Porque no podemos dejar de decir lo que hemos visto y oído.
Ellos entonces los despacharon amenazándolos, no hallando ningún modo de castigarlos, por causa del pueblo; porque todos glorificaban á Dios de lo que había sido hecho.
Porque el hombre en quien había sido hecho este milagro de sanidad, era de más de cuarenta años.
Y sueltos, vinieron á los suyos, y contaron todo lo que los príncipes de los sacerdotes y los ancianos les habían dicho.
Y ellos, habiéndolo oído, alzaron unánimes la voz á Dios, y dijeron: Señor, tú eres el Dios que hiciste el cielo y la tierra, la mar, y todo lo que en ellos hay;
Que por boca de David, tu siervo, dijiste: ¿Por qué han bramado las gentes, y los pueblos han pensado cosas vanas?
Asistieron los reyes de la tierra, y los príncipes se juntaron en uno contra el Señor, y contra su Cristo.
Porque verdaderamente se juntaron en esta ciudad contra tu santo Hijo Jesús, al cual ungiste, Herodes y Poncio Pilato, con los Gentiles y los pueblos de Israel,
Para hacer lo que tu mano y tu consejo habían antes determinado que había de ser hecho.
Y ahora, Señor, mira sus amenazas, y da á tus siervos que con toda confianza hablen tu palabra;
Que extiendas tu mano á que sanidades, y milagros, y prodigios sean hechos por el nombre de tu santo Hijo Jesús.
Y como hubieron orado, el lugar en que estaban congregados tembló; y todos fueron llenos del Espíritu Santo, y hablaron la palabra de Dios con confianza.
Y la multitud de los que habían creído era de un corazón y un alma: y ninguno decía ser suyo algo de lo que poseía; mas todas las cosas les eran comunes.
Y los apóstoles daban testimonio de la resurrección del Señor Jesús con gran esfuerzo; y gran gracia era en todos ellos.
Que ningún necesitado había entre ellos: porque todos los que poseían heredades ó casas, vendiéndolas, traían el precio de lo vendido,
Y lo ponían á los pies de los apóstoles; y era repartido á cada uno según que había menester.
Entonces José, que fué llamado de los apóstoles por sobrenombre, Bernabé, (que es interpretado, Hijo de consolación) Levita, natural de Cipro,
Como tuviese una heredad, la vendió, y trajo el precio, y púsolo á los pies de los apóstoles.
MAS un varón llamado Ananías, con Safira su mujer, vendió una posesión,
Y defraudó del precio, sabiéndolo también su mujer; y trayendo una parte, púsola á los pies de los apóstoles.
Y dijo Pedro: Ananías, ¿por qué ha llenado Satanás tu corazón á que mintieses al Espíritu Santo, y defraudases del precio de la heredad?
Reteniéndola, ¿no se te quedaba á ti? y vendida, ¿no estaba en tu potestad? ¿Por qué pusiste esto en tu corazón? No has mentido á los hombres, sino á Dios.
Entonces Ananías, oyendo estas palabras, cayó y espiró. Y vino un gran temor sobre todos los que lo oyeron.
Y levantándose los mancebos, le tomaron, y sacándolo, sepultáronlo.
Y pasado espacio como de tres horas, sucedió que entró su mujer, no sabiendo lo que había acontecido.
Entonces Pedro le dijo: Dime: ¿vendisteis en tanto la heredad? Y ella dijo: Sí, en tanto.
Y Pedro le dijo: ¿Por qué os concertasteis para tentar al Espíritu del Señor? He aquí á la puerta los pies de los que han sepultado á tu marido, y te sacarán.
Y luego cayó á los pies de él, y espiró: y entrados los mancebos, la hallaron muerta; y la sacaron, y la sepultaron junto á su marido.
Y vino un gran temor en toda la iglesia, y en todos los que oyeron estas cosas.
Y por las manos de los apóstoles eran hechos muchos milagros y prodigios en el pueblo; y estaban todos unánimes en el pórtico de Salomón.
Y de los otros, ninguno osaba juntarse con ellos; mas el pueblo los alababa grandemente.
Y los que creían en el Señor se aumentaban más, gran número así de hombres como de mujeres;
Tanto que echaban los enfermos por las calles, y los ponían en camas y en lechos, para que viniendo Pedro, á lo menos su sombra tocase á alguno de ellos.
Y aun de las ciudades vecinas concurría multitud á Jerusalem, trayendo enfermos y atormentados de espíritus inmundos; los cuales todos eran curados.
Entonces levantándose el príncipe de los sacerdotes, y todos los que estaban con él, que es la secta de los Saduceos, se llenaron de celo;
Y echaron mano á los apóstoles, y pusiéronlos en la cárcel pública.
Mas el ángel del Señor, abriendo de noche las puertas de la cárcel, y sacándolos, dijo:
Id, y estando en el templo, hablad al pueblo todas las palabras de esta vida.
Mas como llegaron los ministros, y no los hallaron en la cárcel, volvieron, y dieron aviso,
Diciendo: Por cierto, la cárcel hemos hallado cerrada con toda seguridad, y los guardas que estaban delante de las puertas; mas cuando abrimos, á nadie hallamos dentro.
Y cuando oyeron estas palabras el pontífice y el magistrado del templo y los príncipes de los sacerdotes, dudaban en qué vendría á parar aquello.
Pero viniendo uno, dióles esta noticia: He aquí, los varones que echasteis en la cárcel, están en el templo, y enseñan al pueblo.
Entonces fué el magistrado con los ministros, y trájolos sin violencia; porque temían del pueblo ser apedreados.
Y como los trajeron, los presentaron en el concilio: y el príncipe de los sacerdotes les preguntó,
Diciendo: ¿No os denunciamos estrechamente, que no enseñaseis en este nombre? y he aquí, habéis llenado á Jerusalem de vuestra doctrina, y queréis echar sobre nosotros la sangre de este hombre.
Y respondiendo Pedro y los apóstoles, dijeron: Es menester obedecer á Dios antes que á los hombres.
El Dios de nuestros padres levantó á Jesús, al cual vosotros matasteis colgándole en un madero.
A éste ha Dios ensalzado con su diestra por Príncipe y Salvador, para dar á Israel arrepentimiento y remisión de pecados.
Y nosotros somos testigos suyos de estas cosas, y también el Espíritu Santo, el cual ha dado Dios á los que le obedecen.
Ellos, oyendo esto, regañaban, y consultaban matarlos.
Entonces levantándose en el concilio un Fariseo llamado Gamaliel, doctor de la ley, venerable á todo el pueblo, mandó que sacasen fuera un poco á los apóstoles.
Y les dijo: Varones Israelitas, mirad por vosotros acerca de estos hombres en lo que habéis de hacer.
Después de éste, se levantó Judas el Galileo en los días del empadronamiento, y llevó mucho pueblo tras sí. Pereció también aquél; y todos los que consintieron con él, fueron derramados.
Y ahora os digo: Dejaos de estos hombres, y dejadlos; porque si este consejo ó esta obra es de los hombres, se desvanecerá:
Mas si es de Dios, no la podréis deshacer; no seáis tal vez hallados resistiendo á Dios.
Y convinieron con él: y llamando á los apóstoles, después de azotados, les intimaron que no hablasen en el nombre de Jesús, y soltáronlos.
Y ellos partieron de delante del concilio, gozosos de que fuesen tenidos por dignos de padecer afrenta por el Nombre.
Y todos los días, en el templo y por las casas, no cesaban de enseñar y predicar á Jesucristo.
EN aquellos días, creciendo el número de los discípulos, hubo murmuración de los Griegos contra los Hebreos, de que sus viudas eran menospreciadas en el ministerio cotidiano.
Así que, los doce convocaron la multitud de los discípulos, y dijeron: No es justo que nosotros dejemos la palabra de Dios, y sirvamos á las mesas.
Buscad pues, hermanos, siete varones de vosotros de buen testimonio, llenos de Espíritu Santo y de sabiduría, los cuales pongamos en esta obra.
Y nosotros persistiremos en la oración, y en el ministerio de la palabra.
Y plugo el parecer á toda la multitud; y eligieron á Esteban, varón lleno de fe y de Espíritu Santo, y á Felipe, y á Prócoro, y á Nicanor, y á Timón, y á Parmenas, y á Nicolás, prosélito de Antioquía:
A estos presentaron delante de los apóstoles, los cuales orando les pusieron las manos encima.
Y crecía la palabra del Señor, y el número de los discípulos se multiplicaba mucho en Jerusalem: también una gran multitud de los sacerdotes obedecía á la fe.
Empero Esteban, lleno de gracia y de potencia, hacía prodigios y milagros grandes en el pueblo.
Levantáronse entonces unos de la sinagoga que se llama de los Libertinos, y Cireneos, y Alejandrinos, y de los de Cilicia, y de Asia, disputando con Esteban.
Mas no podían resistir á la sabiduría y al Espíritu con que hablaba.
Entonces sobornaron á unos que dijesen que le habían oído hablar palabras blasfemas contra Moisés y Dios.
Y conmovieron al pueblo, y á los ancianos, y á los escribas; y arremetiendo le arrebataron, y le trajeron al concilio.
Y pusieron testigos falsos, que dijesen: Este hombre no cesa de hablar palabras blasfemas contra este lugar santo y la ley:
Porque le hemos oído decir, que este Jesús de Nazaret destruirá este lugar, y mudará las ordenanzas que nos dió Moisés.
Entonces todos los que estaban sentados en el concilio, puestos los ojos en él, vieron su rostro como el rostro de un ángel.
EL príncipe de los sacerdotes dijo entonces: ¿Es esto así?
Y él dijo: Varones hermanos y padres, oid: El Dios de la gloria apareció á nuestro padre Abraham, estando en Mesopotamia, antes que morase en Chârán,
Y le dijo: Sal de tu tierra y de tu parentela, y ven á la tierra que te mostraré.
Entonces salió de la tierra de los Caldeos, y habitó en Chârán: y de allí, muerto su padre, le traspasó á esta tierra, en la cual vosotros habitáis ahora;
Y no le dió herencia en ella, ni aun para asentar un pie: mas le prometió que se la daría en posesión, y á su simiente después de él, no teniendo hijo.
Y hablóle Dios así: Que su simiente sería extranjera en tierra ajena, y que los reducirían á servidumbre y maltratarían, por cuatrocientos años.
Mas yo juzgaré, dijo Dios, la nación á la cual serán siervos: y después de esto saldrán y me servirán en este lugar.
Y los patriarcas, movidos de envidia, vendieron á José para Egipto; mas Dios era con él,
Y le libró de todas sus tribulaciones, y le dió gracia y sabiduría en la presencia de Faraón, rey de Egipto, el cual le puso por gobernador sobre Egipto, y sobre toda su casa.
Vino entonces hambre en toda la tierra de Egipto y de Canaán, y grande tribulación; y nuestros padres no hallaban alimentos.
Y como oyese Jacob que había trigo en Egipto, envió á nuestros padres la primera vez.
Y en la segunda, José fué conocido de sus hermanos, y fué sabido de Faraón el linaje de José.
Y enviando José, hizo venir á su padre Jacob, y á toda su parentela, en número de setenta y cinco personas.
Así descendió Jacob á Egipto, donde murió él y nuestros padres;
Los cuales fueron trasladados á Sichêm, y puestos en el sepulcro que compró Abraham á precio de dinero de los hijos de Hemor de Sichêm.
Mas como se acercaba el tiempo de la promesa, la cual Dios había jurado á Abraham, el pueblo creció y multiplicóse en Egipto,
Hasta que se levantó otro rey en Egipto que no conocía á José.
Este, usando de astucia con nuestro linaje, maltrató á nuestros padres, á fin de que pusiesen á peligro de muerte sus niños, para que cesase la generación.
En aquel mismo tiempo nació Moisés, y fué agradable á Dios: y fué criado tres meses en casa de su padre.
Mas siendo puesto al peligro, la hija de Faraón le tomó, y le crió como á hijo suyo.
Y fué enseñado Moisés en toda la sabiduría de los egipcios; y era poderoso en sus dichos y hechos.
Y cuando hubo cumplido la edad de cuarenta años, le vino voluntad de visitar á sus hermanos los hijos de Israel.
Y como vió á uno que era injuriado, defendióle, é hiriendo al Egipcio, vengó al injuriado.
Pero él pensaba que sus hermanos entendían que Dios les había de dar salud por su mano; mas ellos no lo habían entendido.
Y al día siguiente, riñendo ellos, se les mostró, y los ponía en paz, diciendo: Varones, hermanos sois, ¿por qué os injuriáis los unos á los otros?
Entonces el que injuriaba á su prójimo, le rempujó, diciendo: ¿Quién te ha puesto por príncipe y juez sobre nosotros?
¿Quieres tú matarme, como mataste ayer al Egipcio?
A esta palabra Moisés huyó, y se hizo extranjero en tierra de Madián, donde engendró dos hijos.
Y cumplidos cuarenta años, un ángel le apareció en el desierto del monte Sina, en fuego de llama de una zarza.
Entonces Moisés mirando, se maravilló de la visión: y llegándose para considerar, fué hecha á él voz del Señor:
Yo soy el Dios de tus padres, el Dios de Abraham, y el Dios de Isaac, y el Dios de Jacob. Mas Moisés, temeroso, no osaba mirar.
Y le dijo el Señor: Quita los zapatos de tus pies, porque el lugar en que estás es tierra santa.
He visto, he visto la aflicción de mi pueblo que está en Egipto, y he oído el gemido de ellos, y he descendido para librarlos. Ahora pues, ven, te enviaré á Egipto.
A este Moisés, al cual habían rehusado, diciendo: ¿Quién te ha puesto por príncipe y juez? á éste envió Dios por príncipe y redentor con la mano del ángel que le apareció en la zarza.
Este los sacó, habiendo hecho prodigios y milagros en la tierra de Egipto, y en el mar Bermejo, y en el desierto por cuarenta años.
Este es el Moisés, el cual dijo á los hijos de Israel: Profeta os levantará el Señor Dios vuestro de vuestros hermanos, como yo; á él oiréis.
Este es aquél que estuvo en la congregación en el desierto con el ángel que le hablaba en el monte Sina, y con nuestros padres; y recibió las palabras de vida para darnos:
Al cual nuestros padres no quisieron obedecer; antes le desecharon, y se apartaron de corazón á Egipto,
Diciendo á Aarón: Haznos dioses que vayan delante de nosotros; porque á este Moisés, que nos sacó de tierra de Egipto, no sabemos qué le ha acontecido.
Y entonces hicieron un becerro, y ofrecieron sacrificio al ídolo, y en las obras de sus manos se holgaron.
Antes, trajisteis el tabernáculo de Moloch, y la estrella de vuestro dios Remphan: figuras que os hicisteis para adorarlas: os transportaré pues, más allá de Babilonia.
Tuvieron nuestros padres el tabernáculo del testimonio en el desierto, como había ordenado Dios, hablando á Moisés que lo hiciese según la forma que había visto.
El cual recibido, metieron también nuestros padres con Josué en la posesión de los Gentiles, que Dios echó de la presencia de nuestros padres, hasta los días de David;
El cual halló gracia delante de Dios, y pidió hallar tabernáculo para el Dios de Jacob.
Mas Salomón le edificó casa.
Si bien el Altísimo no habita en templos hechos de mano; como el profeta dice:
El cielo es mi trono, y la tierra es el estrado de mis pies. ¿Qué casa me edificaréis? dice el Señor; ¿ó cuál es el lugar de mi reposo?
¿No hizo mi mano todas estas cosas?
Duros de cerviz, é incircuncisos de corazón y de oídos, vosotros resistís siempre al Espíritu Santo: como vuestros padres, así también vosotros.
¿A cuál de los profetas no persiguieron vuestros padres? y mataron á los que antes anunciaron la venida del Justo, del cual vosotros ahora habéis sido entregadores y matadores;
Que recibisteis la ley por disposición de ángeles, y no la guardasteis.
Y oyendo estas cosas, regañaban de sus corazones, y crujían los dientes contra él.
Mas él, estando lleno de Espíritu Santo, puestos los ojos en el cielo, vió la gloria de Dios, y á Jesús que estaba á la diestra de Dios,
Y dijo: He aquí, veo los cielos abiertos, y al Hijo del hombre que está á la diestra de Dios.
Entonces dando grandes voces, se taparon sus oídos, y arremetieron unánimes contra él;
Y echándolo fuera de la ciudad, le apedreaban: y los testigos pusieron sus vestidos á los pies de un mancebo que se llamaba Saulo.
Y apedrearon á Esteban, invocando él y diciendo: Señor Jesús, recibe mi espíritu.
Y puesto de rodillas, clamó á gran voz: Señor, no les imputes este pecado. Y habiendo dicho esto, durmió.
Y llevaroná enterrará Esteban varones piadosos, é hicieron gran llanto sobre él.
Entonces Saulo asolaba la iglesia, entrando por las casas: y trayendo hombres y mujeres, los entregaba en la cárcel.
Mas los que fueron esparcidos, iban por todas partes anunciando la palabra.
Entonces Felipe, descendiendo á la ciudad de Samaria, les predicaba á Cristo.
Y las gentes escuchaban atentamente unánimes las cosas que decía Felipe, oyendo y viendo las señales que hacía.
Porque de muchos que tenían espíritus inmundos, salíanéstosdando grandes voces; y muchos paralíticos y cojos eran sanados:
Así que había gran gozo en aquella ciudad.
Y había un hombre llamado Simón, el cual había sido antes mágico en aquella ciudad, y había engañado la gente de Samaria, diciéndose ser algún grande:
Al cual oían todos atentamente desde el más pequeño hasta el más grande, diciendo: Este es la gran virtud de Dios.
Y le estaban atentos, porque con sus artes mágicas los había embelesado mucho tiempo.
Mas cuando creyeron á Felipe, que anunciaba el evangelio del reino de Dios y el nombre de Jesucristo, se bautizaban hombres y mujeres.
El mismo Simón creyó también entonces, y bautizándose, se llegó á Felipe: y viendo los milagros y grandes maravillas que se hacían, estaba atónito.
Y los apóstoles que estaban en Jerusalem, habiendo oído que Samaria había recibido la palabra de Dios, les enviaron á Pedro y á Juan:
Los cuales venidos, oraron por ellos, para que recibiesen el Espíritu Santo;
(Porque aun no había descendido sobre ninguno de ellos, mas solamente eran bautizados en el nombre de Jesús.)
Entonces les impusieron las manos, y recibieron el Espíritu Santo.
Y como vió Simón que por la imposición de las manos de los apóstoles se daba el Espíritu Santo, les ofreció dinero,
Diciendo: Dadme también á mí esta potestad, que á cualquiera que pusiere las manos encima, reciba el Espíritu Santo.
Entonces Pedro le dijo: Tu dinero perezca contigo, que piensas que el don de Dios se gane por dinero.
No tienes tú parte ni suerte en este negocio; porque tu corazón no es recto delante de Dios.
Arrepiéntete pues de esta tu maldad, y ruega á Dios, si quizás te será perdonado el pensamiento de tu corazón.
Porque en hiel de amargura y en prisión de maldad veo que estás.
Respondiendo entonces Simón, dijo: Rogad vosotros por mí al Señor, que ninguna cosa de estas que habéis dicho, venga sobre mí.
Y ellos, habiendo testificado y hablado la palabra de Dios, se volvieron á Jerusalem, y en muchas tierras de los Samaritanos anunciaron el evangelio.
Empero el ángel del Señor habló á Felipe, diciendo: Levántate y ve hacia el mediodía, al camino que desciende de Jerusalem á Gaza, el cual es desierto.
Entonces él se levantó, y fué: y he aquí un Etiope, eunuco, gobernador de Candace, reina de los Etiopes, el cual era puesto sobre todos sus tesoros, y había venido á adorar á Jerusalem,
Se volvía sentado en su carro, y leyendo el profeta Isaías.
Y el Espíritu dijo á Felipe: Llégate, y júntate á este carro.
Y acudiendo Felipe, le oyó que leía el profeta Isaías, y dijo: Mas ¿entiendes lo que lees?
Y él dijo: ¿Y cómo podré, si alguno no me enseñare? Y rogó á Felipe que subiese, y se sentase con él.
Y el lugar de la Escritura que leía, era éste: Como oveja á la muerte fué llevado; y como cordero mudo delante del que le trasquila, así no abrió su boca:
En su humillación su juicio fué quitado: mas su generación, ¿quién la contará? porque es quitada de la tierra su vida.
Y respondiendo el eunuco á Felipe, dijo: Ruégote ¿de quién el profeta dice esto? ¿de sí, ó de otro alguno?
Entonces Felipe, abriendo su boca, y comenzando desde esta escritura, le anunció el evangelio de Jesús.
Y yendo por el camino, llegaron á cierta agua; y dijo el eunuco: He aquí agua; ¿qué impide que yo sea bautizado?
Y mandó parar el carro: y descendieron ambos al agua, Felipe y el eunuco; y bautizóle.
Y como subieron del agua, el Espíritu del Señor arrebató á Felipe; y no le vió más el eunuco, y se fué por su camino gozoso.
Felipe empero se halló en Azoto: y pasando, anunciaba el evangelio en todas las ciudades, hasta que llegó á Cesarea.
Y SAULO, respirando aún amenazas y muerte contra los discípulos del Señor, vino al príncipe de los sacerdotes,
Y demandó de él letras para Damasco á las sinagogas, para que si hallase algunos hombres ó mujeres de esta secta, los trajese presos á Jerusalem.
Y yendo por el camino, aconteció que llegando cerca de Damasco, súbitamente le cercó un resplandor de luz del cielo;
Y cayendo en tierra, oyó una voz que le decía: Saulo, Saulo, ¿por qué me persigues?
Y él dijo: ¿Quién eres, Señor? Y él dijo: Yo soy Jesús á quien tú persigues: dura cosa te es dar coces contra el aguijón.
El, temblando y temeroso, dijo: Señor, ¿qué quieres que haga? Y el Señor le dice: Levántate y entra en la ciudad, y se te dirá lo que te conviene hacer.
Y los hombres que iban con Saulo, se pararon atónitos, oyendo á la verdad la voz, mas no viendo á nadie.
Entonces Saulo se levantó de tierra, y abriendo los ojos, no veía á nadie: así que, llevándole por la mano, metiéronle en Damasco;
Donde estuvo tres días sin ver, y no comió, ni bebió.
Había entonces un discípulo en Damasco llamado Ananías, al cual el Señor dijo en visión: Ananías. Y él respondió: Heme aquí, Señor.
Y el Señor le dijo: Levántate, y ve á la calle que se llama la Derecha, y busca en casa de Judas á uno llamado Saulo, de Tarso: porque he aquí, él ora;
Y ha visto en visión un varón llamado Ananías, que entra y le pone la mano encima, para que reciba la vista.
Entonces Ananías respondió: Señor, he oído á muchos acerca de este hombre, cuántos males ha hecho á tus santos en Jerusalem:
Y aun aquí tiene facultad de los príncipes de los sacerdotes de prender á todos los que invocan tu nombre.
Y le dijo el Señor: Ve: porque instrumento escogido me es éste, para que lleve mi nombre en presencia de los Gentiles, y de reyes, y de los hijos de Israel:
Porque yo le mostraré cuánto le sea menester que padezca por mi nombre.
Y luego le cayeron de los ojos como escamas, y recibió al punto la vista: y levantándose, fué bautizado.
Y como comió, fué confortado. Y estuvo Saulo por algunos días con los discípulos que estaban en Damasco.
Y luego en las sinagogas predicaba á Cristo, diciendo que éste era el Hijo de Dios.
Y todos los que le oían estaban atónitos, y decían: ¿No es éste el que asolaba en Jerusalem á los que invocaban este nombre, y á eso vino acá, para llevarlos presos á los príncipes de los sacerdotes?
Empero Saulo mucho más se esforzaba, y confundía á los Judíos que moraban en Damasco, afirmando que éste es el Cristo.
Y como pasaron muchos días, los Judíos hicieron entre sí consejo de matarle;
Mas las asechanzas de ellos fueron entendidas de Saulo. Y ellos guardaban las puertas de día y de noche para matarle.
Entonces los discípulos, tomándole de noche, le bajaron por el muro en una espuerta.
Y como vino á Jerusalem, tentaba de juntarse con los discípulos; mas todos tenían miedo de él, no creyendo que era discípulo.
Y entraba y salía con ellos en Jerusalem;
Y hablaba confiadamente en el nombre del Señor: y disputaba con los Griegos; mas ellos procuraban matarle.
Lo cual, como los hermanos entendieron, le acompañaron hasta Cesarea, y le enviaron á Tarso.
Las iglesias entonces tenían paz por toda Judea y Galilea y Samaria, y eran edificadas, andando en el temor del Señor; y con consuelo del Espíritu Santo eran multiplicadas.
Y aconteció que Pedro, andándolos á todos, vino también á los santos que habitaban en Lydda.
Y halló allí á uno que se llamaba Eneas, que hacía ocho años que estaba en cama, que era paralítico.
Y le dijo Pedro: Eneas, Jesucristo te sana; levántate, y hazte tu cama. Y luego se levantó.
Y viéronle todos los que habitaban en Lydda y en Sarona, los cuales se convirtieron al Señor.
Entonces en Joppe había una discípula llamada Tabita, que si lo declaras, quiere decir Dorcas. Esta era llena de buenas obras y de limosnas que hacía.
Y aconteció en aquellos días que enfermando, murió; á la cual, después de lavada, pusieron en una sala.
Y como Lydda estaba cerca de Joppe, los discípulos, oyendo que Pedro estaba allí, le enviaron dos hombres, rogándole: No te detengas en venir hasta nosotros.
Entonces echados fuera todos, Pedro puesto de rodillas, oró; y vuelto al cuerpo, dijo: Tabita, levántate. Y ella abrió los ojos, y viendo á Pedro, incorporóse.
Y él le dió la mano, y levantóla: entonces llamando á los santos y las viudas, la presentó viva.
Esto fué notorio por toda Joppe; y creyeron muchos en el Señor.
Y aconteció que se quedó muchos días en Joppe en casa de un cierto Simón, curtidor.
Y HABÍA un varón en Cesarea llamado Cornelio, centurión de la compañía que se llamaba la Italiana,
Pío y temeroso de Dios con toda su casa, y que hacía muchas limosnas al pueblo, y oraba á Dios siempre.
Este vió en visión manifiestamente, como á la hora nona del día, que un ángel de Dios entraba á él, y le decía: Cornelio.
Y él, puestos en él los ojos, espantado, dijo: ¿Qué es, Señor? Y díjole: Tus oraciones y tus limosnas han subido en memoria á la presencia de Dios.
Envía pues ahora hombres á Joppe, y haz venir á un Simón, que tiene por sobrenombre Pedro.
Este posa en casa de un Simón, curtidor, que tiene su casa junto á la mar: él te dirá lo que te conviene hacer.
E ido el ángel que hablaba con Cornelio, llamó dos de sus criados, y un devoto soldado de los que le asistían;
A los cuales, después de habérselo contado todo, los envió á Joppe.
Y al día siguiente, yendo ellos su camino, y llegando cerca de la ciudad, Pedro subió á la azotea á orar, cerca de la hora de sexta;
Y aconteció que le vino una grande hambre, y quiso comer; pero mientras disponían, sobrevínole un éxtasis;
Y vió el cielo abierto, y que descendía un vaso, como un gran lienzo, que atado de los cuatro cabos era bajado á la tierra;
En el cual había de todos los animales cuadrúpedos de la tierra, y reptiles, y aves del cielo.
Y le vino una voz: Levántate, Pedro, mata y come.
Entonces Pedro dijo: Señor, no; porque ninguna cosa común é inmunda he comido jamás.
Y volvió la voz hacia él la segunda vez: Lo que Dios limpió, no lo llames tú común.
Y esto fué hecho por tres veces; y el vaso volvió á ser recogido en el cielo.
Y estando Pedro dudando dentro de sí qué sería la visión que había visto, he aquí, los hombres que habían sido enviados por Cornelio, que, preguntando por la casa de Simón, llegaron á la puerta.
Y llamando, preguntaron si un Simón que tenía por sobrenombre Pedro, posaba allí.
Y estando Pedro pensando en la visión, le dijo el Espíritu: He aquí, tres hombres te buscan.
Levántate, pues, y desciende, y no dudes ir con ellos; porque yo los he enviado.
Entonces Pedro, descendiendo á los hombres que eran enviados por Cornelio, dijo: He aquí, yo soy el que buscáis: ¿cuál es la causa por la que habéis venido?
Entonces metiéndolos dentro, los hospedó. Y al día siguiente, levantándose, se fué con ellos; y le acompañaron algunos de los hermanos de Joppe.
Y al otro día entraron en Cesarea. Y Cornelio los estaba esperando, habiendo llamado á sus parientes y los amigos más familiares.
Y como Pedro entró, salió Cornelio á recibirle; y derribándose á sus pies, adoró.
Mas Pedro le levantó, diciendo: Levántate; yo mismo también soy hombre.
Y hablando con él, entró, y halló á muchos que se habían juntado.
Por lo cual, llamado, he venido sin dudar. Así que pregunto: ¿por qué causa me habéis hecho venir?
Entonces Cornelio dijo: Cuatro días ha que á esta hora yo estaba ayuno; y á la hora de nona estando orando en mi casa, he aquí, un varón se puso delante de mí en vestido resplandeciente.
Y dijo: Cornelio, tu oración es oída, y tus limosnas han venido en memoria en la presencia de Dios.
Envía pues á Joppe, y haz venir á un Simón, que tiene por sobrenombre Pedro; éste posa en casa de Simón, curtidor, junto á la mar; el cual venido, te hablará.
Así que, luego envié á ti; y tú has hecho bien en venir. Ahora pues, todos nosotros estamos aquí en la presencia de Dios, para oir todo lo que Dios te ha mandado.
Entonces Pedro, abriendo su boca, dijo: Por verdad hallo que Dios no hace acepción de personas;
Sino que de cualquiera nación que le teme y obra justicia, se agrada.
Envió palabra Dios á los hijos de Israel, anunciando la paz por Jesucristo; éste es el Señor de todos.
Vosotros sabéis lo que fué divulgado por toda Judea; comenzando desde Galilea después del bautismo que Juan predicó,
Cuanto á Jesús de Nazaret; cómo le ungió Dios de Espíritu Santo y de potencia; el cual anduvo haciendo bienes, y sanando á todos los oprimidos del diablo; porque Dios era con él.
Y nosotros somos testigos de todas las cosas que hizo en la tierra de Judea, y en Jerusalem; al cual mataron colgándole en un madero.
A éste levantó Dios al tercer día, é hizo que apareciese manifiesto,
No á todo el pueblo, sino á los testigos que Dios antes había ordenado, es á saber, á nosotros que comimos y bebimos con él, después que resucitó de los muertos.
Y nos mandó que predicásemos al pueblo, y testificásemos que él es el que Dios ha puesto por Juez de vivos y muertos.
A éste dan testimonio todos los profetas, de que todos los que en él creyeren, recibirán perdón de pecados por su nombre.
Estando aún hablando Pedro estas palabras, el Espíritu Santo cayó sobre todos los que oían el sermón.
Y se espantaron los fieles que eran de la circuncisión, que habían venido con Pedro, de que también sobre los Gentiles se derramase el don del Espíritu Santo.
Porque los oían que hablaban en lenguas, y que magnificaban á Dios.
Entonces respondió Pedro: ¿Puede alguno impedir el agua, para que no sean bautizados éstos que han recibido el Espíritu Santo también como nosotros?
Y les mandó bautizar en el nombre del Señor Jesús. Entonces le rogaron que se quedase por algunos días.
Y OYERON los apóstoles y los hermanos que estaban en Judea, que también los Gentiles habían recibido la palabra de Dios.
Y como Pedro subió á Jerusalem, contendían contra él los que eran de la circuncisión,
Diciendo: ¿Por qué has entrado á hombres incircuncisos, y has comido con ellos?
Entonces comenzando Pedro, les declaró por orden lo pasado, diciendo:
Estaba yo en la ciudad de Joppe orando, y vi en rapto de entendimiento una visión: un vaso, como un gran lienzo, que descendía, que por los cuatro cabos era abajado del cielo, y venía hasta mí.
En el cual como puse los ojos, consideré y vi animales terrestres de cuatro pies, y fieras, y reptiles, y aves del cielo.
Y oí una voz que me decía: Levántate, Pedro, mata y come.
Y dije: Señor, no; porque ninguna cosa común ó inmunda entró jamás en mi boca.
Entonces la voz me respondió del cielo segunda vez: Lo que Dios limpió, no lo llames tú común.
Y esto fué hecho por tres veces: y volvió todo á ser tomado arriba en el cielo.
Y he aquí, luego sobrevinieron tres hombres á la casa donde yo estaba, enviados á mí de Cesarea.
Y el Espíritu me dijo que fuese con ellos sin dudar. Y vinieron también conmigo estos seis hermanos, y entramos en casa de un varón,
El cual nos contó cómo había visto un ángel en su casa, que se paró, y le dijo: Envía á Joppe, y haz venir á un Simón que tiene por sobrenombre Pedro;
El cual te hablará palabras por las cuales serás salvo tú, y toda tu casa.
Y como comencé á hablar, cayó el Espíritu Santo sobre ellos también, como sobre nosotros al principio.
Entonces me acordé del dicho del Señor, como dijo: Juan ciertamente bautizó en agua; mas vosotros seréis bautizados en Espíritu Santo.
Así que, si Dios les dió el mismo don también como á nosotros que hemos creído en el Señor Jesucristo, ¿quién era yo que pudiese estorbar á Dios?
Entonces, oídas estas cosas, callaron, y glorificaron á Dios, diciendo: De manera que también á los Gentiles ha dado Dios arrepentimiento para vida.
Y los que habían sido esparcidos por causa de la tribulación que sobrevino en tiempo de Esteban, anduvieron hasta Fenicia, y Cipro, y Antioquía, no hablando á nadie la palabra, sino sólo á los Judíos.
Y de ellos había unos varones Ciprios y Cirenenses, los cuales como entraron en Antioquía, hablaron á los Griegos, anunciando el evangelio del Señor Jesús.
Y la mano del Señor era con ellos: y creyendo, gran número se convirtió al Señor.
Y llegó la fama de estas cosas á oídos de la iglesia que estaba en Jerusalem: y enviaron á Bernabé que fuese hasta Antioquía.
El cual, como llegó, y vió la gracia de Dios, regocijóse; y exhortó á todos á que permaneciesen en el propósito del corazón en el Señor.
Porque era varón bueno, y lleno de Espíritu Santo y de fe: y mucha compañía fué agregada al Señor.
Después partió Bernabé á Tarso á buscar á Saulo; y hallado, le trajo á Antioquía.
Y conversaron todo un año allí con la iglesia, y enseñaron á mucha gente; y los discípulos fueron llamados Cristianos primeramente en Antioquía.
Y en aquellos días descendieron de Jerusalem profetas á Antioquía.
Y levantándose uno de ellos, llamado Agabo, daba á entender por Espíritu, que había de haber una grande hambre en toda la tierra habitada: la cual hubo en tiempo de Claudio.
Entonces los discípulos, cada uno conforme á lo que tenía, determinaron enviar subsidio á los hermanos que habitaban en Judea:
Lo cual asimismo hicieron, enviándolo á los ancianos por mano de Bernabé y de Saulo.
Y EN el mismo tiempo el rey Herodes echó mano á maltratar algunos de la iglesia.
Y mató á cuchillo á Jacobo, hermano de Juan.
Y viendo que había agradado á los Judíos, pasó adelante para prender también á Pedro. Eran entonces los días de los ázimos.
Y habiéndole preso, púsole en la cárcel, entregándole á cuatro cuaterniones de soldados que le guardasen; queriendo sacarle al pueblo después de la Pascua.
Así que, Pedro era guardado en la cárcel; y la iglesia hacía sin cesar oración á Dios por él.
Y cuando Herodes le había de sacar, aquella misma noche estaba Pedro durmiendo entre dos soldados, preso con dos cadenas, y los guardas delante de la puerta, que guardaban la cárcel.
Y he aquí, el ángel del Señor sobrevino, y una luz resplandeció en la cárcel; é hiriendo á Pedro en el lado, le despertó, diciendo: Levántate prestamente. Y las cadenas se le cayeron de las manos.
Y le dijo el ángel: Cíñete, y átate tus sandalias. Y lo hizo así. Y le dijo: Rodéate tu ropa, y sígueme.
Y saliendo, le seguía; y no sabía que era verdad lo que hacía el ángel, mas pensaba que veía visión.
Entonces Pedro, volviendo en sí, dijo: Ahora entiendo verdaderamente que el Señor ha enviado su ángel, y me ha librado de la mano de Herodes, y de todo el pueblo de los Judíos que me esperaba.
Y habiendo considerado esto, llegó á casa de María la madre de Juan, el que tenía por sobrenombre Marcos, donde muchos estaban juntos orando.
Y tocando Pedro á la puerta del patio, salió una muchacha, para escuchar, llamada Rhode:
La cual como conoció la voz de Pedro, de gozo no abrió el postigo, sino corriendo adentro, dió nueva de que Pedro estaba al postigo.
Y ellos le dijeron: Estás loca. Mas ella afirmaba que así era. Entonces ellos decían: Su ángel es.
Mas Pedro perseveraba en llamar: y cuando abrieron, viéronle, y se espantaron.
Luego que fué de día, hubo no poco alboroto entre los soldados sobre qué se había hecho de Pedro.
Mas Herodes, como le buscó y no le halló, hecha inquisición de los guardas, los mandó llevar. Después descendiendo de Judea á Cesarea, se quedó allí.
Y un día señalado, Herodes vestido de ropa real, se sentó en el tribunal, y arengóles.
Y el pueblo aclamaba: Voz de Dios, y no de hombre.
Y luego el ángel del Señor le hirió, por cuanto no dió la gloria á Dios; y espiró comido de gusanos.
Mas la palabra del Señor crecía y era multiplicada.
Y Bernabé y Saulo volvieron de Jerusalem cumplido su servicio, tomando también consigo á Juan, el que tenía por sobrenombre Marcos.
HABÍA entonces en la iglesia que estaba en Antioquía, profetas y doctores: Bernabé, y Simón el que se llamaba Niger, y Lucio Cireneo, y Manahén, que había sido criado con Herodes el tetrarca, y Saulo.
Ministrando pues éstos al Señor, y ayunando, dijo el Espíritu Santo: Apartadme á Bernabé y á Saulo para la obra para la cual los he llamado.
Entonces habiendo ayunado y orado, y puesto las manos encima de ellos, despidiéronlos.
Y ellos, enviados así por el Espíritu Santo, descendieron á Seleucia; y de allí navegaron á Cipro.
Y llegados á Salamina, anunciaban la palabra de Dios en las sinagogas de los Judíos: y tenían también á Juan en el ministerio.
Y habiendo atravesado toda la isla hasta Papho, hallaron un hombre mago, falso profeta, Judío, llamado Barjesús;
El cual estaba con el procónsul Sergio Paulo, varón prudente. Este, llamando á Bernabé y á Saulo, deseaba oir la palabra de Dios.
Mas les resistía Elimas el encantador (que así se interpreta su nombre), procurando apartar de la fe al procónsul.
Entonces Saulo, que también es Pablo, lleno del Espíritu Santo, poniendo en él los ojos,
Dijo: Oh, lleno de todo engaño y de toda maldad, hijo del diablo, enemigo de toda justicia, ¿no cesarás de trastornar los caminos rectos del Señor?
Entonces el procónsul, viendo lo que había sido hecho, creyó, maravillado de la doctrina del Señor.
Y partidos de Papho, Pablo y sus compañeros arribaron á Perge de Pamphylia: entonces Juan, apartándose de ellos, se volvió á Jerusalem.
Y ellos pasando de Perge, llegaron á Antioquía de Pisidia, y entrando en la sinagoga un día de sábado, sentáronse.
Y después de la lectura de la ley y de los profetas, los príncipes de la sinagoga enviaron á ellos, diciendo: Varones hermanos, si tenéis alguna palabra de exhortación para el pueblo, hablad.
Entonces Pablo, levantándose, hecha señal de silencio con la mano, dice: Varones Israelitas, y los que teméis á Dios, oid:
El Dios del pueblo de Israel escogió á nuestros padres, y ensalzó al pueblo, siendo ellos extranjeros en la tierra de Egipto, y con brazo levantado los sacó de ella.
Y por tiempo como de cuarenta años soportó sus costumbres en el desierto;
Y destruyendo siete naciones en la tierra de Canaán, les repartió por suerte la tierra de ellas.
Y después, como por cuatrocientos y cincuenta años, dióles jueces hasta el profeta Samuel.
Y entonces demandaron rey; y les dió Dios á Saúl, hijo de Cis, varón de la tribu de Benjamín, por cuarenta años.
Y quitado aquél, levantóles por rey á David, al que dió también testimonio, diciendo: He hallado á David, hijo de Jessé, varón conforme á mi corazón, el cual hará todo lo que yo quiero.
De la simiente de éste, Dios, conforme á la promesa, levantó á Jesús por Salvador á Israel;
Predicando Juan delante de la faz de su venida el bautismo de arrepentimiento á todo el pueblo de Israel.
Mas como Juan cumpliese su carrera, dijo: ¿Quién pensáis que soy? No soy yo él; mas he aquí, viene tras mí uno, cuyo calzado de los pies no soy digno de desatar.
Varones hermanos, hijos del linaje de Abraham, y los que entre vosotros temen á Dios, á vosotros es enviada la palabra de esta salud.
Porque los que habitaban en Jerusalem, y sus príncipes, no conociendo á éste, y las voces de los profetas que se leen todos los sábados, condenándole, las cumplieron.
Y sin hallar en él causa de muerte, pidieron á Pilato que le matasen.
Y habiendo cumplido todas las cosas que de él estaban escritas, quitándolo del madero, lo pusieron en el sepulcro.
Mas Dios le levantó de los muertos.
Y él fué visto por muchos días de los que habían subido juntamente con él de Galilea á Jerusalem, los cuales son sus testigos al pueblo.
Y nosotros también os anunciamos el evangelio de aquella promesa que fué hecha á los padres,
La cual Dios ha cumplido á los hijos de ellos, á nosotros, resucitando á Jesús: como también en el salmo segundo está escrito: Mi hijo eres tú, yo te he engendrado hoy.
Y que le levantó de los muertos para nunca más volver á corrupción, así lo dijo: Os daré las misericordias fieles de David.
Por eso dice también en otro lugar: No permitirás que tu Santo vea corrupción.
Porque á la verdad David, habiendo servido en su edad á la voluntad de Dios, durmió, y fué juntado con sus padres, y vió corrupción:
Mas aquel que Dios levantó, no vió corrupción.
Séaos pues notorio, varones hermanos, que por éste os es anunciada remisión de pecados;
Y de todo lo que por la ley de Moisés no pudisteis ser justificados, en éste es justificado todo aquel que creyere.
Mirad, pues, que no venga sobre vosotros lo que está dicho en los profetas;
Mirad, oh menospreciadores, y entonteceos, y desvaneceos; porque yo obro una obra en vuestros días, obra que no creeréis, si alguien os la contare.
Y saliendo ellos de la sinagoga de los Judíos, los Gentiles les rogaron que el sábado siguiente les hablasen estas palabras.
Y despedida la congregación, muchos de los Judíos y de los religiosos prosélitos siguieron á Pablo y á Bernabé; los cuales hablándoles, les persuadían que permaneciesen en la gracia de Dios.
Y el sábado siguiente se juntó casi toda la ciudad á oir la palabra de Dios.
Mas los Judíos, visto el gentío, llenáronse de celo, y se oponían á lo que Pablo decía, contradiciendo y blasfemando.
Porque así nos ha mandado el Señor, diciendo: Te he puesto para luz de los Gentiles, para que seas salud hasta lo postrero de la tierra.
Y los Gentiles oyendo esto, fueron gozosos, y glorificaban la palabra del Señor: y creyeron todos los que estaban ordenados para vida eterna.
Y la palabra del Señor era sembrada por toda aquella provincia.
Mas los Judíos concitaron mujeres pías y honestas, y á los principales de la ciudad, y levantaron persecución contra Pablo y Bernabé, y los echaron de sus términos.
Ellos entonces sacudiendo en ellos el polvo de sus pies, vinieron á Iconio.
Y los discípulos estaban llenos de gozo, y del Espíritu Santo.
Y ACONTECIÓ en Iconio, que entrados juntamente en la sinagoga de los Judíos, hablaron de tal manera, que creyó una grande multitud de Judíos, y asimismo de Griegos.
Mas los Judíos que fueron incrédulos, incitaron y corrompieron los ánimos de los Gentiles contra los hermanos.
Con todo eso se detuvieron allí mucho tiempo, confiados en el Señor, el cual daba testimonio á la palabra de su gracia, dando que señales y milagros fuesen hechos por las manos de ellos.
Mas el vulgo de la ciudad estaba dividido; y unos eran con los Judíos, y otros con los apóstoles.
Y haciendo ímpetu los Judíos y los Gentiles juntamente con sus príncipes, para afrentarlos y apedrearlos,
Habiéndolo entendido, huyeron á Listra y Derbe, ciudades de Licaonia, y por toda la tierra alrededor.
Y allí predicaban el evangelio.
Y un hombre de Listra, impotente de los pies, estaba sentado, cojo desde el vientre de su madre, que jamás había andado.
Este oyó hablar á Pablo; el cual, como puso los ojos en él, y vió que tenía fe para ser sano,
Dijo á gran voz: Levántate derecho sobre tus pies. Y saltó, y anduvo.
Entonces las gentes, visto lo que Pablo había hecho, alzaron la voz, diciendo en lengua licaónica: Dioses semejantes á hombres han descendido á nosotros.
Y á Bernabé llamaban Júpiter, y á Pablo, Mercurio, porque era el que llevaba la palabra.
Y el sacerdote de Júpiter, que estaba delante de la ciudad de ellos, trayendo toros y guirnaldas delante de las puertas, quería con el pueblo sacrificar.
Y como lo oyeron los apóstoles Bernabé y Pablo, rotas sus ropas, se lanzaron al gentío, dando voces,
El cual en las edades pasadas ha dejado á todas las gentes andar en sus caminos;
Si bien no se dejó á sí mismo sin testimonio, haciendo bien, dándonos lluvias del cielo y tiempos fructíferos, hinchiendo de mantenimiento y de alegría nuestros corazones.
Y diciendo estas cosas, apenas apaciguaron el pueblo, para que no les ofreciesen sacrificio.
Entonces sobrevinieron unos Judíos de Antioquía y de Iconio, que persuadieron á la multitud, y habiendo apedreado á Pablo, le sacaron fuera de la ciudad, pensando que estaba muerto.
Mas rodeándole los discípulos, se levantó y entró en la ciudad; y un día después, partió con Bernabé á Derbe.
Y como hubieron anunciado el evangelio á aquella ciudad, y enseñado á muchos, volvieron á Listra, y á Iconio, y á Antioquía,
Confirmando los ánimos de los discípulos, exhortándoles á que permaneciesen en la fe, y que es menester que por muchas tribulaciones entremos en el reino de Dios.
Y habiéndoles constituído ancianos en cada una de las iglesias, y habiendo orado con ayunos, los encomendaron al Señor en el cual habían creído.
Y pasando por Pisidia vinieron á Pamphylia.
Y habiendo predicado la palabra en Perge, descendieron á Atalia;
Y de allí navegaron á Antioquía, donde habían sido encomendados á la gracia de Dios para la obra que habían acabado.
Y habiendo llegado, y reunido la iglesia, relataron cuán grandes cosas había Dios hecho con ellos, y cómo había abierto á los Gentiles la puerta de la fe.
Y se quedaron allí mucho tiempo con los discípulos.
ENTONCES algunos que venían de Judea enseñaban á los hermanos: Que si no os circuncidáis conforme al rito de Moisés, no podéis ser salvos.
Ellos, pues, habiendo sido acompañados de la iglesia, pasaron por la Fenicia y Samaria, contando la conversión de los Gentiles; y daban gran gozo á todos los hermanos.
Y llegados á Jerusalem, fueron recibidos de la iglesia y de los apóstoles y de los ancianos: y refirieron todas las cosas que Dios había hecho con ellos.
Mas algunos de la secta de los Fariseos, que habían creído, se levantaron, diciendo: Que es menester circuncidarlos, y mandarles que guarden la ley de Moisés.
Y se juntaron los apóstoles y los ancianos para conocer de este negocio.
Y Dios, que conoce los corazones, les dió testimonio, dándoles el Espíritu Santo también como á nosotros;
Y ninguna diferencia hizo entre nosotros y ellos, purificando con la fe sus corazones.
Ahora pues, ¿por qué tentáis á Dios, poniendo sobre la cerviz de los discípulos yugo, que ni nuestros padres ni nosotros hemos podido llevar?
Antes por la gracia del Señor Jesús creemos que seremos salvos, como también ellos.
Entonces toda la multitud calló, y oyeron á Bernabé y á Pablo, que contaban cuán grandes maravillas y señales Dios había hecho por ellos entre los Gentiles.
Y después que hubieron callado, Jacobo respondió, diciendo: Varones hermanos, oidme:
Simón ha contado cómo Dios primero visitó á los Gentiles, para tomar de ellos pueblo para su nombre;
Y con esto concuerdan las palabras de los profetas, como está escrito:
Después de esto volveré y restauraré la habitación de David, que estaba caída; y repararé sus ruinas, y la volveré á levantar;
Para que el resto de los hombres busque al Señor, y todos los Gentiles, sobre los cuales es llamado mi nombre, dice el Señor, que hace todas estas cosas.
Conocidas son á Dios desde el siglo todas sus obras.
Por lo cual yo juzgo, que los que de los Gentiles se convierten á Dios, no han de ser inquietados;
Sino escribirles que se aparten de las contaminaciones de los ídolos, y de fornicación, y de ahogado, y de sangre.
Porque Moisés desde los tiempos antiguos tiene en cada ciudad quien le predique en las sinagogas, donde es leído cada sábado.
Y escribir por mano de ellos: Los apóstoles y los ancianos y los hermanos, á los hermanos de los Gentiles que están en Antioquía, y en Siria, y en Cilicia, salud:
Por cuanto hemos oído que algunos que han salido de nosotros, os han inquietado con palabras, trastornando vuestras almas, mandando circuncidaros y guardar la ley, á los cuales no mandamos;
Nos ha parecido, congregados en uno, elegir varones, y enviarlos á vosotros con nuestros amados Bernabé y Pablo,
Hombres que han expuesto sus vidas por el nombre de nuestro Señor Jesucristo.
Así que, enviamos á Judas y á Silas, los cuales también por palabra os harán saber lo mismo.
Que ha parecido bien al Espíritu Santo, y á nosotros, no imponeros ninguna carga más que estas cosas necesarias:
Que os abstengáis de cosas sacrificadas á ídolos, y de sangre, y de ahogado, y de fornicación; de las cuales cosas si os guardareis, bien haréis. Pasadlo bien.
Ellos entonces enviados, descendieron á Antioquía; y juntando la multitud, dieron la carta.
La cual, como leyeron, fueron gozosos de la consolación.
Judas también y Silas, como ellos también eran profetas, consolaron y confirmaron á los hermanos con abundancia de palabra.
Y pasando allí algún tiempo, fueron enviados de los hermanos á los apóstoles en paz.
Y Pablo y Bernabé se estaban en Antioquía, enseñando la palabra del Señor y anunciando el evangelio con otros muchos.
Y después de algunos días, Pablo dijo á Bernabé: Volvamos á visitar á los hermanos por todas las ciudades en las cuales hemos anunciado la palabra del Señor, cómo están.
Y Bernabé quería que tomasen consigo á Juan, el que tenía por sobrenombre Marcos;
Mas á Pablo no le parecía bien llevar consigo al que se había apartado de ellos desde Pamphylia, y no había ido con ellos á la obra.
Y hubo tal contención entre ellos, que se apartaron el uno del otro; y Bernabé tomando á Marcos, navegó á Cipro.
Y Pablo escogiendo á Silas, partió encomendado de los hermanos á la gracia del Señor.
Y anduvo la Siria y la Cilicia, confirmando á las iglesias.
DESPUÉS llegó á Derbe, y á Listra: y he aquí, estaba allí un discípulo llamado Timoteo, hijo de una mujer Judía fiel, mas de padre Griego.
De éste daban buen testimonio los hermanos que estaban en Listra y en Iconio.
Este quiso Pablo que fuese con él; y tomándole, le circuncidó por causa de los Judíos que estaban en aquellos lugares; porque todos sabían que su padre era Griego.
Y como pasaban por las ciudades, les daban que guardasen los decretos que habían sido determinados por los apóstoles y los ancianos que estaban en Jerusalem.
Así que, las iglesias eran confirmadas en fe, y eran aumentadas en número cada día.
Y pasando á Phrygia y la provincia de Galacia, les fué prohibido por el Espíritu Santo hablar la palabra en Asia.
Y como vinieron á Misia, tentaron de ir á Bithynia; mas el Espíritu no les dejó.
Y pasando á Misia, descendieron á Troas.
Y fué mostrada á Pablo de noche una visión: Un varón Macedonio se puso delante, rogándole, y diciendo: Pasa á Macedonia, y ayúdanos.
Y como vió la visión, luego procuramos partir á Macedonia, dando por cierto que Dios nos llamaba para que les anunciásemos el evangelio.
Partidos pues de Troas, vinimos camino derecho á Samotracia, y el día siguiente á Neápolis;
Y de allí á Filipos, que es la primera ciudad de la parte de Macedonia, yuna colonia; y estuvimos en aquella ciudad algunos días.
Y un día de sábado salimos de la puerta junto al río, donde solía ser la oración; y sentándonos, hablamos á las mujeres que se habían juntado.
Entonces una mujer llamada Lidia, que vendía púrpura en la ciudad de Tiatira, temerosa de Dios, estaba oyendo; el corazón de la cual abrió el Señor para que estuviese atenta á lo que Pablo decía.
Y cuando fué bautizada, y su familia, nos rogó, diciendo: Si habéis juzgado que yo sea fiel al Señor, entrad en mi casa, y posad: y constriñónos.
Y aconteció, que yendo nosotros á la oración, una muchacha que tenía espíritu pitónico, nos salió al encuentro, la cual daba grande ganancia á sus amos adivinando.
Esta, siguiendo á Pablo y á nosotros, daba voces, diciendo: Estos hombres son siervos del Dios Alto, los cuales os anuncian el camino de salud.
Y esto hacía por muchos días; mas desagradando á Pablo, se volvió y dijo al espíritu: Te mando en el nombre de Jesucristo, que salgas de ella. Y salió en la misma hora.
Y viendo sus amos que había salido la esperanza de su ganancia, prendieron á Pablo y á Silas, y los trajeron al foro, al magistrado;
Y presentándolos á los magistrados, dijeron: Estos hombres, siendo Judíos, alborotan nuestra ciudad,
Y predican ritos, los cuales no nos es lícito recibir ni hacer, pues somos Romanos.
Y agolpóse el pueblo contra ellos: y los magistrados rompiéndoles sus ropas, les mandaron azotar con varas.
Y después que los hubieron herido de muchos azotes, los echaron en la cárcel, mandando al carcelero que los guardase con diligencia:
El cual, recibido este mandamiento, los metió en la cárcel de más adentro; y les apretó los pies en el cepo.
Mas á media noche, orando Pablo y Silas, cantaban himnos á Dios: y los que estaban presos los oían.
Entonces fué hecho de repente un gran terremoto, de tal manera que los cimientos de la cárcel se movían; y luego todas las puertas se abrieron, y las prisiones de todos se soltaron.
Y despertado el carcelero, como vió abiertas las puertas de la cárcel, sacando la espada se quería matar, pensando que los presos se habían huído.
Mas Pablo clamó á gran voz, diciendo: No te hagas ningún mal; que todos estamos aquí.
El entonces pidiendo luz, entró dentro, y temblando, derribóse á los pies de Pablo y de Silas;
Y sacándolos fuera, les dice: Señores, ¿qué es menester que yo haga para ser salvo?
Y ellos dijeron: Cree en el Señor Jesucristo, y serás salvo tú, y tu casa.
Y le hablaron la palabra del Señor, y á todos los que estaban en su casa.
Y tomándolos en aquella misma hora de la noche, les lavó los azotes; y se bautizó luego él, y todos los suyos.
Y llevándolos á su casa, les puso la mesa: y se gozó de que con toda su casa había creído á Dios.
Y como fué de día, los magistrados enviaron los alguaciles, diciendo: Deja ir á aquellos hombres.
Y el carcelero hizo saber estas palabras á Pablo: Los magistrados han enviado á decir que seáis sueltos: así que ahora salid, é id en paz.
Y los alguaciles volvieron á decir á los magistrados estas palabras: y tuvieron miedo, oído que eran Romanos.
Y viniendo, les rogaron; y sacándolos, les pidieron que se saliesen de la ciudad.
Entonces salidos de la cárcel, entraron en casa de Lidia; y habiendo visto á los hermanos, los consolaron, y se salieron.
Y PASANDO por Amphípolis y Apolonia, llegaron á Tesalónica, donde estaba la sinagoga de los Judíos.
Y Pablo, como acostumbraba, entró á ellos, y por tres sábados disputó con ellos de las Escrituras,
Declarando y proponiendo, que convenía que el Cristo padeciese, y resucitase de los muertos; y que Jesús, el cual yo os anuncio, decía él, éste era el Cristo.
Y algunos de ellos creyeron, y se juntaron con Pablo y con Silas; y de los Griegos religiosos grande multitud, y mujeres nobles no pocas.
Mas no hallándolos, trajeron á Jasón y á algunos hermanos á los gobernadores de la ciudad, dando voces: Estos que alborotan el mundo, también han venido acá;
A los cuales Jasón ha recibido; y todos estos hacen contra los decretos de César, diciendo que hay otro rey, Jesús.
Y alborotaron al pueblo y á los gobernadores de la ciudad, oyendo estas cosas.
Mas recibida satisfacción de Jasón y de los demás, los soltaron.
Entonces los hermanos, luego de noche, enviaron á Pablo y á Silas á Berea; los cuales habiendo llegado, entraron en la sinagoga de los Judíos.
Y fueron éstos más nobles que los que estaban en Tesalónica, pues recibieron la palabra con toda solicitud, escudriñando cada día las Escrituras, si estas cosas eran así.
Así que creyeron muchos de ellos; y mujeres Griegas de distinción, y no pocos hombres.
Mas como entendieron los Judíos de Tesalónica que también en Berea era anunciada la palabra de Dios por Pablo, fueron, y también allí tumultuaron al pueblo.
Empero luego los hermanos enviaron á Pablo que fuese como á la mar; y Silas y Timoteo se quedaron allí.
Y los que habían tomado á cargo á Pablo, le llevaron hasta Atenas; y tomando encargo para Silas y Timoteo, que viniesen á él lo más presto que pudiesen, partieron.
Y esperándolos Pablo en Atenas, su espíritu se deshacía en él viendo la ciudad dada á idolatría.
Así que, disputaba en la sinagoga con los Judíos y religiosos; y en la plaza cada día con los que le ocurrían.
Y tomándole, le trajeron al Areópago, diciendo: ¿Podremos saber qué sea esta nueva doctrina que dices?
Porque pones en nuestros oídos unas nuevas cosas: queremos pues saber qué quiere ser esto.
(Entonces todos los Atenienses y los huéspedes extranjeros, en ninguna otra cosa entendían, sino ó en decir ó en oir alguna cosa nueva.)
Estando pues Pablo en medio del Areópago, dijo: Varones Atenienses, en todo os veo como más supersticiosos;
Porque pasando y mirando vuestros santuarios, hallé también un altar en el cual estaba esta inscripción: AL DIOS NO CONOCIDO. Aquél pues, que vosotros honráis sin conocerle, á éste os anuncio yo.
El Dios que hizo el mundo y todas las cosas que en él hay, éste, como sea Señor del cielo y de la tierra, no habita en templos hechos de manos,
Ni es honrado con manos de hombres, necesitado de algo; pues él da á todos vida, y respiración, y todas las cosas;
Y de una sangre ha hecho todo el linaje de los hombres, para que habitasen sobre toda la faz de la tierra; y les ha prefijado el orden de los tiempos, y los términos de la habitación de ellos;
Para que buscasen á Dios, si en alguna manera, palpando, le hallen; aunque cierto no está lejos de cada uno de nosotros:
Porque en él vivimos, y nos movemos, y somos; como también algunos de vuestros poetas dijeron: Porque linaje de éste somos también.
Siendo pues linaje de Dios, no hemos de estimar la Divinidad ser semejante á oro, ó á plata, ó á piedra, escultura de artificio ó de imaginación de hombres.
Empero Dios, habiendo disimulado los tiempos de esta ignorancia, ahora denuncia á todos los hombres en todos los lugares que se arrepientan:
Por cuanto ha establecido un día, en el cual ha de juzgar al mundo con justicia, por aquel varón al cual determinó; dando fe á todos con haberle levantado de los muertos.
Y así como oyeron de la resurrección de los muertos, unos se burlaban, y otros decían: Te oiremos acerca de esto otra vez.
Y así Pablo se salió de en medio de ellos.
Mas algunos creyeron, juntándose con él; entre los cuales también fué Dionisio el del Areópago, y una mujer llamada Dámaris, y otros con ellos.
PASADAS estas cosas, Pablo partió de Atenas, y vino á Corinto.
Y porque era de su oficio, posó con ellos, y trabajaba; porque el oficio de ellos era hacer tiendas.
Y disputaba en la sinagoga todos los sábados, y persuadía á Judíos y á Griegos.
Y cuando Silas y Timoteo vinieron de Macedonia, Pablo estaba constreñido por la palabra, testificando á los Judíos que Jesús era el Cristo.
Mas contradiciendo y blasfemando ellos, les dijo, sacudiendo sus vestidos: Vuestra sangre sea sobre vuestra cabeza; yo, limpio; desde ahora me iré á los Gentiles.
Y partiendo de allí, entró en casa de uno llamado Justo, temeroso de Dios, la casa del cual estaba junto á la sinagoga.
Y Crispo, el prepósito de la sinagoga, creyó al Señor con toda su casa: y muchos de los Corintios oyendo creían, y eran bautizados.
Entonces el Señor dijo de noche en visión á Pablo: No temas, sino habla, y no calles:
Porque yo estoy contigo, y ninguno te podrá hacer mal; porque yo tengo mucho pueblo en esta ciudad.
Y se detuvo allí un año y seis meses, enseñándoles la palabra de Dios.
Y siendo Galión procónsul de Acaya, los Judíos se levantaron de común acuerdo contra Pablo, y le llevaron al tribunal,
Diciendo: Que éste persuade á los hombres á honrar á Dios contra la ley.
Y comenzando Pablo á abrir la boca, Galión dijo á los Judíos: Si fuera algún agravio ó algún crimen enorme, oh Judíos, conforme á derecho yo os tolerara:
Mas si son cuestiones de palabras, y de nombres, y de vuestra ley, vedlo vosotros; porque yo no quiero ser juez de estas cosas.
Y los echó del tribunal.
Entonces todos los Griegos tomando á Sóstenes, prepósito de la sinagoga, le herían delante del tribunal: y á Galión nada se le daba de ello.
Mas Pablo habiéndose detenido aún allí muchos días, después se despidió de los hermanos, y navegó á Siria, y con él Priscila y Aquila, habiéndose trasquilado la cabeza en Cencreas, porque tenía voto.
Y llegó á Efeso, y los dejó allí: y él entrando en la sinagoga, disputó con los Judíos,
Los cuales le rogaban que se quedase con ellos por más tiempo; mas no accedió,
Sino que se despidió de ellos, diciendo: Es menester que en todo caso tenga la fiesta que viene, en Jerusalem; mas otra vez volveré á vosotros, queriendo Dios. Y partió de Efeso.
Y habiendo arribado á Cesarea subió á Jerusalem; y después de saludar á la iglesia, descendió á Antioquía.
Y habiendo estado allí algún tiempo, partió, andando por orden la provincia de Galacia, y la Phrygia, confirmando á todos los discípulos.
Llegó entonces á Efeso un Judío, llamado Apolos, natural de Alejandría, varón elocuente, poderoso en las Escrituras.
Este era instruído en el camino del Señor; y ferviente de espíritu, hablaba y enseñaba diligentemente las cosas que son del Señor, enseñando solamente en el bautismo de Juan.
Y comenzó á hablar confiadamente en la sinagoga: al cual como oyeron Priscila y Aquila, le tomaron, y le declararon más particularmente el camino de Dios.
Y queriendo él pasar á Acaya, los hermanos exhortados, escribieron á los discípulos que le recibiesen; y venido él, aprovechó mucho por la gracia á los que habían creído:
Porque con gran vehemencia convencía públicamente á los Judíos, mostrando por las Escrituras que Jesús era el Cristo.
Y ACONTECIÓ que entre tanto que Apolos estaba en Corinto, Pablo, andadas las regiones superiores, vino á Efeso, y hallando ciertos discípulos,
Díjoles: ¿Habéis recibido el Espíritu Santo después que creísteis? Y ellos le dijeron: Antes ni aun hemos oído si hay Espíritu Santo.
Entonces dijo: ¿En qué pues sois bautizados? Y ellos dijeron: En el bautismo de Juan.
Y dijo Pablo: Juan bautizó con bautismo de arrepentimiento, diciendo al pueblo que creyesen en el que había de venir después de él, es á saber, en Jesús el Cristo.
Oído que hubieron esto, fueron bautizados en el nombre del Señor Jesús.
Y habiéndoles impuesto Pablo las manos, vino sobre ellos el Espíritu Santo; y hablaban en lenguas, y profetizaban.
Y eran en todos como unos doce hombres.
Y entrando él dentro de la sinagoga, hablaba libremente por espacio de tres meses, disputando y persuadiendo del reino de Dios.
Mas endureciéndose algunos y no creyendo, maldiciendo el Camino delante de la multitud, apartándose Pablo de ellos separó á los discípulos, disputando cada día en la escuela de un cierto Tyranno.
Y esto fué por espacio de dos años; de manera que todos los que habitaban en Asia, Judíos y Griegos, oyeron la palabra del Señor Jesús.
Y hacía Dios singulares maravillas por manos de Pablo:
De tal manera que aun se llevaban sobre los enfermos los sudarios y los pañuelos de su cuerpo, y las enfermedades se iban de ellos, y los malos espíritus salían de ellos.
Y algunos de los Judíos, exorcistas vagabundos, tentaron á invocar el nombre del Señor Jesús sobre los que tenían espíritus malos, diciendo: Os conjuro por Jesús, el que Pablo predica.
Y había siete hijos de un tal Sceva, Judío, príncipe de los sacerdotes, que hacían esto.
Y respondiendo el espíritu malo, dijo: A Jesús conozco, y sé quién es Pablo: mas vosotros ¿quiénes sois?
Y el hombre en quien estaba el espíritu malo, saltando en ellos, y enseñoreándose de ellos, pudo más que ellos, de tal manera que huyeron de aquella casa desnudos y heridos.
Y esto fué notorio á todos, así Judíos como Griegos, los que habitaban en Efeso: y cayó temor sobre todos ellos, y era ensalzado el nombre del Señor Jesús.
Y muchos de los que habían creído, venían, confesando y dando cuenta de sus hechos.
Asimismo muchos de los que habían practicado vanas artes, trajeron los libros, y los quemaron delante de todos; y echada la cuenta del precio de ellos, hallaron ser cincuenta mil denarios.
Así crecía poderosamente la palabra del Señor, y prevalecía.
Y acabadas estas cosas, se propuso Pablo en espíritu partir á Jerusalem, después de andada Macedonia y Acaya, diciendo: Después que hubiere estado allá, me será menester ver también á Roma.
Y enviando á Macedonia á dos de los que le ayudaban, Timoteo y Erasto, él se estuvo por algún tiempo en Asia.
Entonces hubo un alboroto no pequeño acerca del Camino.
Porque un platero llamado Demetrio, el cual hacía de plata templecillos de Diana, daba á los artífices no poca ganancia;
A los cuales, reunidos con los oficiales de semejante oficio, dijo: Varones, sabéis que de este oficio tenemos ganancia;
Y veis y oís que este Pablo, no solamente en Efeso, sino á muchas gentes de casi toda el Asia, ha apartado con persuasión, diciendo, que no son dioses los que se hacen con las manos.
Oídas estas cosas, llenáronse de ira, y dieron alarido, diciendo: ¡Grande es Diana de los Efesios!
Y la ciudad se llenó de confusión; y unánimes se arrojaron al teatro, arrebatando á Gayo y á Aristarco, Macedonios, compañeros de Pablo.
Y queriendo Pablo salir al pueblo, los discípulos no le dejaron.
También algunos de los principales de Asia, que eran sus amigos, enviaron á él rogando que no se presentase en el teatro.
Y otros gritaban otra cosa; porque la concurrencia estaba confusa, y los más no sabían por qué se habían juntado.
Y sacaron de entre la multitud á Alejandro, empujándole los Judíos. Entonces Alejandro, pedido silencio con la mano, quería dar razón al pueblo.
Mas como conocieron que era Judío, fué hecha un voz de todos, que gritaron casi por dos horas: ¡Grande es Diana de los Efesios!
Así que, pues esto no puede ser contradicho, conviene que os apacigüéis, y que nada hagáis temerariamente;
Pues habéis traído á estos hombres, sin ser sacrílegos ni blasfemadores de vuestra diosa.
Que si Demetrio y los oficiales que están con él tienen negocio con alguno, audiencias se hacen, y procónsules hay; acúsense los unos á los otros.
Y si demandáis alguna otra cosa, en legítima asamblea se pueda decidir.
Porque peligro hay de que seamos argüidos de sedición por hoy, no habiendo ninguna causa por la cual podamos dar razón de este concurso. Y habiendo dicho esto, despidió la concurrencia.
Y DESPUÉS que cesó el alboroto, llamando Pablo á los discípulos habiéndoles exhortado y abrazado, se despidió, y partió para ir á Macedonia.
Y andado que hubo aquellas partes, y exhortádoles con abundancia de palabra, vino á Grecia.
Y después de haber estado allí tres meses, y habiendo de navegar á Siria, le fueron puestas asechanzas por los Judíos; y así tomó consejo de volverse por Macedonia.
Y le acompañaron hasta Asia Sopater Bereense, y los Tesalonicenses, Aristarco y Segundo; y Gayo de Derbe, y Timoteo; y de Asia, Tychîco y Trófimo.
Estos yendo delante, nos esperaron en Troas.
Y nosotros, pasados los días de los panes sin levadura, navegamos de Filipos y vinimos á ellos á Troas en cinco días, donde estuvimos siete días.
Y el día primero de la semana, juntos los discípulos á partir el pan, Pablo les enseñaba, habiendo de partir al día siguiente: y alargó el discurso hasta la media noche.
Y había muchas lámparas en el aposento alto donde estaban juntos.
Entonces descendió Pablo, y derribóse sobre él, y abrazándole, dijo: No os alborotéis, que su alma está en él.
Después subiendo, y partiendo el pan, y gustando, habló largamente hasta el alba, y así partió.
Y llevaron al mozo vivo, y fueron consolados no poco.
Y nosotros subiendo en el navío, navegamos á Assón, para recibir de allí á Pablo; pues así había determinado que debía él ir por tierra.
Y como se juntó con nosotros en Assón, tomándole vinimos á Mitilene.
Y navegando de allí, al día siguiente llegamos delante de Chîo, y al otro día tomamos puerto en Samo: y habiendo reposado en Trogilio, al día siguiente llegamos á Mileto.
Porque Pablo se había propuesto pasar adelante de Efeso; por no detenerse en Asia: porque se apresuraba por hacer el día de Pentecostés, si le fuese posible, en Jerusalem.
Y enviando desde Mileto á Efeso, hizo llamar á los ancianos de la iglesia.
Y cuando vinieron á él, les dijo: Vosotros sabéis cómo, desde el primer día que entré en Asia, he estado con vosotros por todo el tiempo,
Sirviendo al Señor con toda humildad, y con muchas lágrimas, y tentaciones que me han venido por las asechanzas de los Judíos:
Cómo nada que fuese útil he rehuído de anunciaros y enseñaros, públicamente y por las casas,
Testificando á los Judíos y á los Gentiles arrepentimiento para con Dios, y la fe en nuestro Señor Jesucristo.
Y ahora, he aquí, ligado yo en espíritu, voy á Jerusalem, sin saber lo que allá me ha de acontecer:
Mas que el Espíritu Santo por todas las ciudades me da testimonio, diciendo que prisiones y tribulaciones me esperan.
Y ahora, he aquí, yo sé que ninguno de todos vosotros, por quien he pasado predicando el reino de Dios, verá más mi rostro.
Por tanto, yo os protesto el día de hoy, que yo soy limpio de la sangre de todos:
Porque no he rehuído de anunciaros todo el consejo de Dios.
Por tanto mirad por vosotros, y por todo el rebaño en que el Espíritu Santo os ha puesto por obispos, para apacentar la iglesia del Señor, la cual ganó por su sangre.
Porque yo sé que después de mi partida entrarán en medio de vosotros lobos rapaces, que no perdonarán al ganado;
Y de vosotros mismos se levantarán hombres que hablen cosas perversas, para llevar discípulos tras sí.
Por tanto, velad, acordándoos que por tres años de noche y de día, no he cesado de amonestar con lágrimas á cada uno.
Y ahora, hermanos, os encomiendo á Dios, y á la palabra de su gracia: el cual es poderoso para sobreedificar, y daros heredad con todos los santificados.
La plata, ó el oro, ó el vestido de nadie he codiciado.
Antes vosotros sabéis que para lo que me ha sido necesario, y á los que están conmigo, estas manos me han servido.
En todo os he enseñado que, trabajando así, es necesario sobrellevar á los enfermos, y tener presente las palabras del Señor Jesús, el cual dijo: Más bienaventurada cosa es dar que recibir.
Y como hubo dicho estas cosas, se puso de rodillas, y oró con todos ellos.
Entonces hubo un gran lloro de todos: y echándose en el cuello de Pablo, le besaban,
Doliéndose en gran manera por la palabra que dijo, que no habían de ver más su rostro. Y le acompañaron al navío.
Y HABIENDO partido de ellos, navegamos y vinimos camino derecho á Coos, y al día siguiente á Rhodas, y de allí á Pátara.
Y hallando un barco que pasaba á Fenicia, nos embarcamos, y partimos.
Y como avistamos á Cipro, dejándola á mano izquierda, navegamos á Siria, y vinimos á Tiro: porque el barco había de descargar allí su carga.
Y nos quedamos allí siete días, hallados los discípulos, los cuales decían á Pablo por Espíritu, que no subiese á Jerusalem.
Y cumplidos aquellos días, salimos acompañándonos todos, consusmujeres é hijos, hasta fuera de la ciudad; y puestos de rodillas en la ribera, oramos.
Y abrazándonos los unos á los otros, subimos al barco, y ellos se volvieron á sus casas.
Y nosotros, cumplida la navegación, vinimos de Tiro á Tolemaida; y habiendo saludado á los hermanos, nos quedamos con ellos un día.
Y otro día, partidos Pablo y los que con él estábamos, vinimos á Cesarea: y entrando en casa de Felipe el evangelista, el cual era uno de los siete, posamos con él.
Y éste tenía cuatro hijas, doncellas, que profetizaban.
Y parando nosotros allí por muchos días, descendió de Judea un profeta, llamado Agabo;
Lo cual como oímos, le rogamos nosotros y los de aquel lugar, que no subiese á Jerusalem.
Entonces Pablo respondió: ¿Qué hacéis llorando y afligiéndome el corazón? porque yo no sólo estoy presto á ser atado, mas aun á morir en Jerusalem por el nombre del Señor Jesús.
Y como no le pudimos persuadir, desistimos, diciendo: Hágase la voluntad del Señor.
Y después de estos días, apercibidos, subimos á Jerusalem.
Y vinieron también con nosotros de Cesarea algunos de los discípulos, trayendo consigo á un Mnasón, Cyprio, discípulo antiguo, con el cual posásemos.
Y cuando llegamos á Jerusalem, los hermanos nos recibieron de buena voluntad.
Y al día siguiente Pablo entró con nosotros á Jacobo, y todos los ancianos se juntaron;
A los cuales, como los hubo saludado, contó por menudo lo que Dios había hecho entre los Gentiles por su ministerio.
Y ellos como lo oyeron, glorificaron á Dios, y le dijeron: Ya ves, hermano, cuántos millares de Judíos hay que han creído; y todos son celadores de la ley:
Mas fueron informados acerca de ti, que enseñas á apartarse de Moisés á todos los Judíos que están entre los Gentiles, diciéndoles que no han de circuncidar á los hijos, ni andar según la costumbre.
¿Qué hay pues? La multitud se reunirá de cierto: porque oirán que has venido.
Haz pues esto que te decimos: Hay entre nosotros cuatro hombres que tienen voto sobre sí:
Y cuando estaban para acabarse los siete días, unos Judíos de Asia, como le vieron en el templo, alborotaron todo el pueblo y le echaron mano,
Porque antes habían visto con él en la ciudad á Trófimo, Efesio, al cual pensaban que Pablo había metido en el templo.
Así que, toda la ciudad se alborotó, y agolpóse el pueblo; y tomando á Pablo, hiciéronle salir fuera del templo, y luego las puertas fueron cerradas.
Y procurando ellos matarle, fué dado aviso al tribuno de la compañía, que toda la ciudad de Jerusalem estaba alborotada;
El cual tomando luego soldados y centuriones, corrió á ellos. Y ellos como vieron al tribuno y á los soldados, cesaron de herir á Pablo.
Entonces llegando el tribuno, le prendió, y le mandó atar con dos cadenas; y preguntó quién era, y qué había hecho.
Y entre la multitud, unos gritaban una cosa, y otros otra: y como no podía entender nada de cierto á causa del alboroto, le mandó llevar á la fortaleza.
Y como llegó á las gradas, aconteció que fué llevado de los soldados á causa de la violencia del pueblo;
Porque multitud de pueblo venía detrás, gritando: Mátale.
Y como comenzaron á meter á Pablo en la fortaleza, dice al tribuno: ¿Me será lícito hablarte algo? Y él dijo: ¿Sabes griego?
¿No eres tú aquel Egipcio que levantaste una sedición antes de estos días, y sacaste al desierto cuatro mil hombres salteadores?
Entonces dijo Pablo: Yo de cierto soy hombre Judío, ciudadano de Tarso, ciudad no obscura de Cilicia: empero ruégote que me permitas que hable al pueblo.
Y como él se lo permitió, Pablo, estando en pie en las gradas, hizo señal con la mano al pueblo. Y hecho grande silencio, habló en lengua hebrea, diciendo:
VARONES hermanos y padres, oid la razón que ahora os doy.
(Y como oyeron que les hablaba en lengua hebrea, guardaron más silencio.) Y dijo:
Que he perseguido este camino hasta la muerte, prendiendo y entregando en cárceles hombres y mujeres:
Mas aconteció que yendo yo, y llegando cerca de Damasco, como á medio día, de repente me rodeó mucha luz del cielo:
Y caí en el suelo, y oí una voz que me decía: Saulo, Saulo, ¿por qué me persigues?
Yo entonces respondí: ¿Quién eres, Señor? Y me dijo: Yo soy Jesús de Nazaret, á quien tú persigues.
Y los que estaban conmigo vieron á la verdad la luz, y se espantaron; mas no oyeron la voz del que hablaba conmigo.
Y dije: ¿Qué haré, Señor? Y el Señor me dijo: Levántate, y ve á Damasco, y allí te será dicho todo lo que te está señalado hacer.
Y como yo no viese por causa de la claridad de la luz, llevado de la mano por los que estaban conmigo, vine á Damasco.
Entonces un Ananías, varón pío conforme á la ley, que tenía buen testimonio de todos los Judíos que allí moraban,
Viniendo á mí, y acercándose, me dijo: Hermano Saulo, recibe la vista. Y yo en aquella hora le miré.
Y él dijo: El Dios de nuestros padres te ha predestinado para que conocieses su voluntad, y vieses á aquel Justo, y oyeses la voz de su boca.
Porque has de ser testigo suyo á todos los hombres, de lo que has visto y oído.
Ahora pues, ¿por qué te detienes? Levántate, y bautízate, y lava tus pecados, invocando su nombre.
Y me aconteció, vuelto á Jerusalem, que orando en el templo, fuí arrebatado fuera de mí.
Y le vi que me decía: Date prisa, y sal prestamente fuera de Jerusalem; porque no recibirán tu testimonio de mí.
Y yo dije: Señor, ellos saben que yo encerraba en cárcel, y hería por las sinagogas á los que creían en ti;
Y cuando se derramaba la sangre de Esteban tu testigo, yo también estaba presente, y consentía á su muerte, y guardaba las ropas de los que le mataban.
Y me dijo: Ve, porque yo te tengo que enviar lejos á los Gentiles.
Y le oyeron hasta esta palabra: entonces alzaron la voz, diciendo: Quita de la tierra á un tal hombre, porque no conviene que viva.
Y dando ellos voces, y arrojando sus ropas y echando polvo al aire,
Mandó el tribuno que le llevasen á la fortaleza, y ordenó que fuese examinado con azotes, para saber por qué causa clamaban así contra él.
Y como le ataron con correas, Pablo dijo al centurión que estaba presente: ¿Os es lícito azotar á un hombre Romano sin ser condenado?
Y como el centurión oyó esto, fué y dió aviso al tribuno, diciendo: ¿Qué vas á hacer? porque este hombre es Romano.
Y viniendo el tribuno, le dijo: Dime, ¿eres tú Romano? Y él dijo: Sí.
Y respondió el tribuno: Yo con grande suma alcancé esta ciudadanía. Entonces Pablo dijo: Pero yo lo soy de nacimiento.
Así que, luego se apartaron de él los que le habían de atormentar: y aun el tribuno también tuvo temor, entendido que era Romano, por haberle atado.
ENTONCES Pablo, poniendo los ojos en el concilio, dice: Varones hermanos, yo con toda buena conciencia he conversado delante de Dios hasta el día de hoy.
El príncipe de los sacerdotes, Ananías, mandó entonces á los que estaban delante de él, que le hiriesen en la boca.
Entonces Pablo le dijo: Herirte ha Dios, pared blanqueada: ¿y estás tú sentado para juzgarme conforme á la ley, y contra la ley me mandas herir?
Y los que estaban presentes dijeron: ¿Al sumo sacerdote de Dios maldices?
Y Pablo dijo: No sabía, hermanos, que era el sumo sacerdote; pues escrito está: Al príncipe de tu pueblo no maldecirás.
Y como hubo dicho esto, fué hecha disensión entre los Fariseos y los Saduceos; y la multitud fué dividida.
Porque los Saduceos dicen que no hay resurrección, ni ángel, ni espíritu; mas los Fariseos confiesan ambas cosas.
Y la noche siguiente, presentándosele el Señor, le dijo: Confía, Pablo; que como has testificado de mí en Jerusalem, así es menester testifiques también en Roma.
Y venido el día, algunos de los Judíos se juntaron, é hicieron voto bajo de maldición, diciendo que ni comerían ni beberían hasta que hubiesen muerto á Pablo.
Y eran más de cuarenta los que habían hecho esta conjuración;
Los cuales se fueron á los príncipes de los sacerdotes y á los ancianos, y dijeron: Nosotros hemos hecho voto debajo de maldición, que no hemos de gustar nada hasta que hayamos muerto á Pablo.
Entonces un hijo de la hermana de Pablo, oyendo las asechanzas, fué, y entró en la fortaleza, y dió aviso á Pablo.
Y Pablo, llamando á uno de los centuriones, dice: Lleva á este mancebo al tribuno, porque tiene cierto aviso que darle.
El entonces tomándole, le llevó al tribuno, y dijo: El preso Pablo, llamándome, me rogó que trajese á ti este mancebo, que tiene algo que hablarte.
Y el tribuno, tomándole de la mano y retirándose aparte, le preguntó: ¿Qué es lo que tienes que decirme?
Y él dijo: Los Judíos han concertado rogarte que mañana saques á Pablo al concilio, como que han de inquirir de él alguna cosa más cierta.
Entonces el tribuno despidió al mancebo, mandándole que á nadie dijese que le había dado aviso de esto.
Y que aparejasen cabalgaduras en que poniendo á Pablo, le llevasen en salvo á Félix el Presidente.
Y escribió una carta en estos términos:
Claudio Lisias al excelentísimo gobernador Félix: Salud.
A este hombre, aprehendido de los Judíos, y que iban ellos á matar, libré yo acudiendo con la tropa, habiendo entendido que era Romano.
Y queriendo saber la causa por qué le acusaban, le llevé al concilio de ellos:
Y hallé que le acusaban de cuestiones de la ley de ellos, y que ningún crimen tenía digno de muerte ó de prisión.
Y los soldados, tomando á Pablo como les era mandado, lleváronle de noche á Antipatris.
Y al día siguiente, dejando á los de á caballo que fuesen con él, se volvieron á la fortaleza.
Y como llegaron á Cesarea, y dieron la carta al gobernador, presentaron también á Pablo delante de él.
Y el gobernador, leída la carta, preguntó de qué provincia era; y entendiendo que de Cilicia,
Te oiré, dijo, cuando vinieren tus acusadores. Y mandó que le guardasen en el pretorio de Herodes.
Y CINCO días después descendió el sumo sacerdote Ananías, con algunos de los ancianos, y un cierto Tértulo, orador; y parecieron delante del gobernador contra Pablo.
Y citado que fué, Tértulo comenzó á acusar, diciendo: Como por causa tuya vivamos en grande paz, y muchas cosas sean bien gobernadas en el pueblo por tu prudencia,
Siempre y en todo lugar lo recibimos con todo hacimiento de gracias, oh excelentísimo Félix.
Empero por no molestarte más largamente, ruégote que nos oigas brevemente conforme á tu equidad.
Porque hemos hallado que este hombre es pestilencial, y levantador de sediciones entre todos los Judíos por todo el mundo, y príncipe de la secta de los Nazarenos:
El cual también tentó á violar el templo; y prendiéndole, le quisimos juzgar conforme á nuestra ley:
Mandando á sus acusadores que viniesen á ti; del cual tú mismo juzgando, podrás entender todas estas cosas de que le acusamos.
Y contendían también los Judíos, diciendo ser así estas cosas.
Entonces Pablo, haciéndole el gobernador señal que hablase, respondió: Porque sé que muchos años ha eres gobernador de esta nación, con buen ánimo satisfaré por mí.
Porque tú puedes entender que no hace más de doce días que subí á adorar á Jerusalem;
Y ni me hallaron en el templo disputando con ninguno, ni haciendo concurso de multitud, ni en sinagogas, ni en la ciudad;
Ni te pueden probar las cosas de que ahora me acusan.
Teniendo esperanza en Dios que ha de haber resurrección de los muertos, así de justos como de injustos, la cual también ellos esperan.
Y por esto, procuro yo tener siempre conciencia sin remordimiento acerca de Dios y acerca de los hombres.
Mas pasados muchos años, vine á hacer limosnas á mi nación, y ofrendas,
Cuando me hallaron purificado en el templo (no con multitud ni con alboroto) unos Judíos de Asia;
Los cuales debieron comparecer delante de ti, y acusarme, si contra mí tenían algo.
O digan estos mismos si hallaron en mí alguna cosa mal hecha, cuando yo estuve en el concilio,
Si no sea que, estando entre ellos prorrumpí en alta voz: Acerca de la resurrección de los muertos soy hoy juzgado de vosotros.
Entonces Félix, oídas estas cosas, estando bien informado de esta secta, les puso dilación, diciendo: Cuando descendiere el tribuno Lisias acabaré de conocer de vuestro negocio.
Y mandó al centurión que Pablo fuese guardado, y aliviado de las prisiones; y que no vedase á ninguno de sus familiares servirle, ó venir á él.
Y algunos días después, viniendo Félix con Drusila, su mujer, la cual era Judía, llamó á Pablo, y oyó de él la fe que es en Jesucristo.
Y disertando él de la justicia, y de la continencia, y del juicio venidero, espantado Félix, respondió: Ahora vete; mas en teniendo oportunidad te llamaré:
Esperando también con esto, que de parte de Pablo le serían dados dineros, porque le soltase; por lo cual, haciéndole venir muchas veces, hablaba con él.
Mas al cabo de dos años recibió Félix por sucesor á Porcio Festo: y queriendo Félix ganar la gracia de los Judíos, dejó preso á Pablo.
FESTO pues, entrado en la provincia, tres días después subió de Cesarea á Jerusalem.
Y vinieron á él los príncipes de los sacerdotes y los principales de los Judíos contra Pablo; y le rogaron,
Pidiendo gracia contra él, que le hiciese traer á Jerusalem, poniendo ellos asechanzas para matarle en el camino.
Mas Festo respondió, que Pablo estaba guardado en Cesarea, y que él mismo partiría presto.
Los que de vosotros pueden, dijo, desciendan juntamente; y si hay algún crimen en este varón, acúsenle.
Y deteniéndose entre ellos no más de ocho ó diez días, venido á Cesarea, el siguiente día se sentó en el tribunal, y mandó que Pablo fuese traído.
El cual venido, le rodearon los Judíos que habían venido de Jerusalem, poniendo contra Pablo muchas y graves acusaciones, las cuales no podían probar;
Alegando él por su parte: Ni contra la ley de los Judíos, ni contra el templo, ni contra César he pecado en nada.
Mas Festo, queriendo congraciarse con los Judíos, respondiendo á Pablo, dijo: ¿Quieres subir á Jerusalem, y allá ser juzgado de estas cosas delante de mí?
Y Pablo dijo: Ante el tribunal de César estoy, donde conviene que sea juzgado. A los Judíos no he hecho injuria ninguna, como tú sabes muy bien.
Entonces Festo, habiendo hablado con el consejo, respondió: ¿A César has apelado? á César irás.
Y pasados algunos días, el rey Agripa y Bernice vinieron á Cesarea á saludar á Festo.
Y como estuvieron allí muchos días, Festo declaró la causa de Pablo al rey, diciendo: Un hombre ha sido dejado preso por Félix,
Sobre el cual, cuando fuí á Jerusalem, vinieron á mí los príncipes de los sacerdotes y los ancianos de los Judíos, pidiendo condenación contra él:
Así que, habiendo venido ellos juntos acá, sin ninguna dilación, al día siguiente, sentado en el tribunal, mandé traer al hombre;
Y estando presentes los acusadores, ningún cargo produjeron de los que yo sospechaba:
Solamente tenían contra él ciertas cuestiones acerca de su superstición, y de un cierto Jesús, difunto, el cual Pablo afirmaba que estaba vivo.
Y yo, dudando en cuestión semejante, dije, si quería ir á Jerusalem, y allá ser juzgado de estas cosas.
Mas apelando Pablo á ser guardado al conocimiento de Augusto, mandé que le guardasen hasta que le enviara á César.
Entonces Agripa dijo á Festo: Yo también quisiera oir á ese hombre. Y él dijo: Mañana le oirás.
Mas yo, hallando que ninguna cosa digna de muerte ha hecho, y él mismo apelando á Augusto, he determinado enviarle:
Del cual no tengo cosa cierta que escriba al señor; por lo que le he sacado á vosotros, y mayormente á tí, oh rey Agripa, para que hecha información, tenga yo qué escribir.
Porque fuera de razón me parece enviar un preso, y no informar de las causas.
ENTONCES Agripa dijo á Pablo: Se te permite hablar por ti mismo. Pablo entonces, extendiendo la mano, comenzó á responder por sí, diciendo:
Acerca de todas las cosas de que soy acusado por los Judíos, oh rey Agripa, me tengo por dichoso de que haya hoy de defenderme delante de ti;
Mayormente sabiendo tú todas las costumbres y cuestiones que hay entre los Judíos: por lo cual te ruego que me oigas con paciencia.
Mi vida pues desde la mocedad, la cual desde el principio fué en mi nación, en Jerusalem, todos los Judíos la saben:
Los cuales tienen ya conocido que yo desde el principio, si quieren testificarlo, conforme á la más rigurosa secta de nuestra religión he vivido Fariseo.
Y ahora, por la esperanza de la promesa que hizo Dios á nuestros padres, soy llamado en juicio;
A la cual promesa nuestras doce tribus, sirviendo constantemente de día y de noche, esperan que han de llegar. Por la cual esperanza, oh rey Agripa, soy acusado de los Judíos.
¡Qué! ¿Júzgase cosa increíble entre vosotros que Dios resucite los muertos?
Yo ciertamente había pensado deber hacer muchas cosas contra el nombre de Jesús de Nazaret:
Lo cual también hice en Jerusalem, y yo encerré en cárceles á muchos de los santos, recibida potestad de los príncipes de los sacerdotes; y cuando eran matados, yo dí mi voto.
Y muchas veces, castigándolos por todas las sinagogas, los forcé á blasfemar; y enfurecido sobremanera contra ellos, los perseguí hasta en las ciudades extrañas.
En lo cual ocupado, yendo á Damasco con potestad y comisión de los príncipes de los sacerdotes,
En mitad del día, oh rey, vi en el camino una luz del cielo, que sobrepujaba el resplandor del sol, la cual me rodeó y á los que iban conmigo.
Y habiendo caído todos nosotros en tierra, oí una voz que me hablaba, y decía en lengua hebraica: Saulo, Saulo, ¿por qué me persigues? Dura cosa te es dar coces contra los aguijones.
Yo entonces dije: ¿Quién eres, Señor? Y el Señor dijo: Yo soy Jesús, á quien tú persigues.
Librándote del pueblo y de los Gentiles, á los cuales ahora te envío,
Por lo cual, oh rey Agripa, no fuí rebelde á la visión celestial:
Por causa de esto los Judíos, tomándome en el templo, tentaron matarme.
Mas ayudado del auxilio de Dios, persevero hasta el día de hoy, dando testimonio á pequeños y á grandes, no diciendo nada fuera de las cosas que los profetas y Moisés dijeron que habían de venir:
Que Cristo había de padecer, y ser el primero de la resurrección de los muertos, para anunciar luz al pueblo y á los Gentiles.
Y diciendo él estas cosas en su defensa, Festo á gran voz dijo: Estás loco, Pablo: las muchas letras te vuelven loco.
Mas él dijo: No estoy loco, excelentísimo Festo, sino que hablo palabras de verdad y de templanza.
Pues el rey sabe estas cosas, delante del cual también hablo confiadamente. Pues no pienso que ignora nada de esto; pues no ha sido esto hecho en algún rincón.
¿Crees, rey Agripa, á los profetas? Yo sé que crees.
Entonces Agripa dijo á Pablo: Por poco me persuades á ser Cristiano.
Y Pablo dijo: ¡Pluguiese á Dios que por poco ó por mucho, no solamente tú, mas también todos los que hoy me oyen, fueseis hechos tales cual yo soy, excepto estas prisiones!
Y como hubo dicho estas cosas, se levantó el rey, y el presidente, y Bernice, y los que se habían sentado con ellos;
Y como se retiraron aparte, hablaban los unos á los otros, diciendo: Ninguna cosa digna ni de muerte, ni de prisión, hace este hombre.
Y Agripa dijo á Festo: Podía este hombre ser suelto, si no hubiera apelado á César.
MAS como fué determinado que habíamos de navegar para Italia, entregaron á Pablo y á algunos otros presos á un centurión, llamado Julio, de la compañía Augusta.
Así que, embarcándonos en una nave Adrumentina, partimos, estando con nosotros Aristarco, Macedonio de Tesalónica, para navegar junto á los lugares de Asia.
Y otro día llegamos á Sidón; y Julio, tratando á Pablo con humanidad, permitióle que fuese á los amigos, para ser de ellos asistido.
Y haciéndonos á la vela desde allí, navegamos bajo de Cipro, porque los vientos eran contrarios.
Y habiendo pasado la mar de Cilicia y Pamphylia, arribamos á Mira, ciudad de Licia.
Y hallando allí el centurión una nave Alejandrina que navegaba á Italia, nos puso en ella.
Y navegando muchos días despacio, y habiendo apenas llegado delante de Gnido, no dejándonos el viento, navegamos bajo de Creta, junto á Salmón.
Y costeándola difícilmente, llegamos á un lugar que llaman Buenos Puertos, cerca del cual estaba la ciudad de Lasea.
Y pasado mucho tiempo, y siendo ya peligrosa la navegación, porque ya era pasado el ayuno, Pablo amonestaba,
Diciéndoles: Varones, veo que con trabajo y mucho daño, no sólo de la cargazón y de la nave, mas aun de nuestras personas, habrá de ser la navegación.
Mas el centurión creía más al piloto y al patrón de la nave, que á lo que Pablo decía.
Y soplando el austro, pareciéndoles que ya tenían lo que deseaban, alzando velas, iban cerca de la costa de Creta.
Mas no mucho después dió en ella un viento repentino, que se llama Euroclidón.
Y siendo arrebatada la nave, y no pudiendo resistir contra el viento, la dejamos, y éramos llevados.
Y habiendo corrido á sotavento de una pequeña isla que se llama Clauda, apenas pudimos ganar el esquife:
El cual tomado, usaban de remedios, ciñendo la nave; y teniendo temor de que diesen en la Sirte, abajadas las velas, eran así llevados.
Mas siendo atormentados de una vehemente tempestad, al siguiente día alijaron;
Y al tercer día nosotros con nuestras manos arrojamos los aparejos de la nave.
Y no pareciendo sol ni estrellas por muchos días, y viniendo una tempestad no pequeña, ya era perdida toda la esperanza de nuestra salud.
Mas ahora os amonesto que tengáis buen ánimo; porque ninguna pérdida habrá de persona de vosotros, sino solamente de la nave.
Porque esta noche ha estado conmigo el ángel del Dios del cual yo soy, y al cual sirvo,
Diciendo: Pablo, no temas; es menester que seas presentado delante de César; y he aquí, Dios te ha dado todos los que navegan contigo.
Por tanto, oh varones, tened buen ánimo; porque yo confío en Dios que será así como me ha dicho;
Si bien es menester que demos en una isla.
Y venida la décimacuarta noche, y siendo llevados por el mar Adriático, los marineros á la media noche sospecharon que estaban cerca de alguna tierra;
Y echando la sonda, hallaron veinte brazas; y pasando un poco más adelante, volviendo á echar la sonda, hallaron quince brazas.
Y habiendo temor de dar en lugares escabrosos, echando cuatro anclas de la popa, deseaban que se hiciese de día.
Entonces procurando los marineros huir de la nave, echado que hubieron el esquife á la mar, aparentando como que querían largar las anclas de proa,
Pablo dijo al centurión y á los soldados: Si éstos no quedan en la nave, vosotros no podéis salvaros.
Entonces los soldados cortaron los cabos del esquife, y dejáronlo perder.
Y como comenzó á ser de día, Pablo exhortaba á todos que comiesen, diciendo: Este es el décimocuarto día que esperáis y permanecéis ayunos, no comiendo nada.
Por tanto, os ruego que comáis por vuestra salud: que ni aun un cabello de la cabeza de ninguno de vosotros perecerá.
Y habiendo dicho esto, tomando el pan, hizo gracias á Dios en presencia de todos, y partiendo, comenzó á comer.
Entonces todos teniendo ya mejor ánimo, comieron ellos también.
Y éramos todas las personas en la nave doscientas setenta y seis.
Y satisfechos de comida, aliviaban la nave, echando el grano á la mar.
Y como se hizo de día, no conocían la tierra: mas veían un golfo que tenía orilla, al cual acordaron echar, si pudiesen, la nave.
Cortando pues las anclas, las dejaron en la mar, largando también las ataduras de los gobernalles; y alzada la vela mayor al viento, íbanse á la orilla.
Mas dando en un lugar de dos aguas, hicieron encallar la nave; y la proa, hincada, estaba sin moverse, y la popa se abría con la fuerza de la mar.
Entonces el acuerdo de los soldados era que matasen los presos, porque ninguno se fugase nadando.
Mas el centurión, queriendo salvar á Pablo, estorbó este acuerdo, y mandó que los que pudiesen nadar, se echasen los primeros, y saliesen á tierra;
Y los demás, parte en tablas, parte en cosas de la nave. Y así aconteció que todos se salvaron saliendo á tierra.
Y CUANDO escapamos, entonces supimos que la isla se llamaba Melita.
Y los bárbaros nos mostraron no poca humanidad; porque, encendido un fuego, nos recibieron á todos, á causa de la lluvia que venía, y del frío.
Entonces habiendo Pablo recogido algunos sarmientos, y puéstolos en el fuego, una víbora, huyendo del calor, le acometió á la mano.
Y como los bárbaros vieron la víbora colgando de su mano, decían los unos á los otros: Ciertamente este hombre es homicida, á quien, escapado de la mar, la justicia no deja vivir.
Mas él, sacudiendo la víbora en el fuego, ningún mal padeció.
Empero ellos estaban esperando cuándo se había de hinchar, ó caer muerto de repente; mas habiendo esperado mucho, y viendo que ningún mal le venía, mudados, decían que era un dios.
En aquellos lugares había heredades del principal de la isla, llamado Publio, el cual nos recibió y hospedó tres días humanamente.
Y aconteció que el padre de Publio estaba en cama, enfermo de fiebres y de disentería: al cual Pablo entró, y después de haber orado, le puso las manos encima, y le sanó:
Y esto hecho, también los otros que en la isla tenían enfermedades, llegaban, y eran sanados:
Los cuales también nos honraron con muchos obsequios; y cuando partimos, nos cargaron de las cosas necesarias.
Así que, pasados tres meses, navegamos en una nave Alejandrina que había invernado en la isla, la cual tenía por enseña á Cástor y Pólux.
Y llegados á Siracusa, estuvimos allí tres días.
De allí, costeando alrededor, vinimos á Regio; y otro día después, soplando el austro, vinimos al segundo día á Puteolos:
Donde habiendo hallado hermanos, nos rogaron que quedásemos con ellos siete días; y luego vinimos á Roma;
De donde, oyendo de nosotros los hermanos, nos salieron á recibir hasta la plaza de Appio, y Las Tres Tabernas: á los cuales como Pablo vió, dió gracias á Dios, y tomó aliento.
Y como llegamos á Roma, el centurión entregó los presos al prefecto de los ejércitos, mas á Pablo fué permitido estar por sí, con un soldado que le guardase.
Los cuales, habiéndome examinado, me querían soltar, por no haber en mí ninguna causa de muerte.
Mas contradiciendo los Judíos, fuí forzado á apelar á César; no que tenga de qué acusar á mi nación.
Así que, por esta causa, os he llamado para veros y hablaros; porque por la esperanza de Israel estoy rodeado de esta cadena.
Entonces ellos le dijeron: Nosotros ni hemos recibido cartas tocante á ti de Judea, ni ha venido alguno de los hermanos que haya denunciado ó hablado algún mal de ti.
Mas querríamos oir de ti lo que sientes; porque de esta secta notorio nos es que en todos lugares es contradicha.
Y algunos asentían á lo que se decía, mas algunos no creían.
Y como fueron entre sí discordes, se fueron, diciendo Pablo esta palabra: Bien ha hablado el Espíritu Santo por el profeta Isaías á nuestros padres,
Diciendo: Ve á este pueblo, y diles: De oído oiréis, y no entenderéis; y viendo veréis, y no percibiréis:
Séaos pues notorio que á los Gentiles es enviada esta salud de Dios: y ellos oirán.
Y habiendo dicho esto, los Judíos salieron, teniendo entre sí gran contienda.
Pablo empero, quedó dos años enteros en su casa de alquiler, y recibía á todos los que á él venían,
Predicando el reino de Dios y enseñando lo que es del Señor Jesucristo con toda libertad, sin impedimento.
PABLO, siervo de Jesucristo, llamadoá serapóstol, apartado para el evangelio de Dios,
Que él había antes prometido por sus profetas en las santas Escrituras,
Acerca de su Hijo, (que fué hecho de la simiente de David según la carne;
El cual fué declarado Hijo de Dios con potencia, según el espíritu de santidad, por la resurrección de los muertos), de Jesucristo Señor nuestro,
Por el cual recibimos la gracia y el apostolado, para la obediencia de la fe en todas las naciones en su nombre,
Entre las cuales sois también vosotros, llamados de Jesucristo:
A todos los que estáis en Roma, amados de Dios, llamados santos: Gracia y paz tengáis de Dios nuestro Padre, y del Señor Jesucristo.
Primeramente, doy gracias á mi Dios por Jesucristo acerca de todos vosotros, de que vuestra fe es predicada en todo el mundo.
Porque testigo me es Dios, al cual sirvo en mi espíritu en el evangelio de su Hijo, que sin cesar me acuerdo de vosotros siempre en mis oraciones,
Rogando, si al fin algún tiempo haya de tener, por la voluntad de Dios, próspero viaje para ir á vosotros.
Porque os deseo ver, para repartir con vosotros algún don espiritual, para confirmaros;
Es á saber, para ser juntamente consolado con vosotros por la común fe vuestra y juntamente mía.
A Griegos y á bárbaros, á sabios y á no sabios soy deudor.
Así que, cuanto á mí, presto estoy á anunciar el evangelio también á vosotros que estáis en Roma.
Porque no me avergüenzo del evangelio: porque es potencia de Dios para salud á todo aquel que cree; al Judío primeramente y también al Griego.
Porque en él la justicia de Dios se descubre de fe en fe; como está escrito: Mas el justo vivirá por la fe.
Porque manifiesta es la ira de Dios del cielo contra toda impiedad é injusticia de los hombres, que detienen la verdad con injusticia:
Porque lo que de Dios se conoce, á ellos es manifiesto; porque Dios se lo manifestó.
Porque habiendo conocido á Dios, no le glorificaron como á Dios, ni dieron gracias; antes se desvanecieron en sus discursos, y el necio corazón de ellos fué entenebrecido.
Diciéndose ser sabios, se hicieron fatuos,
Y trocaron la gloria del Dios incorruptible en semejanza de imagen de hombre corruptible, y de aves, y de animales de cuatro pies, y de serpientes.
Por lo cual también Dios los entregó á inmundicia, en las concupiscencias de sus corazones, de suerte que contaminaron sus cuerpos entre sí mismos:
Los cuales mudaron la verdad de Dios en mentira, honrando y sirviendo á las criaturas antes que al Criador, el cual es bendito por los siglos. Amén.
Por esto Dios los entregó á afectos vergonzosos; pues aun sus mujeres mudaron el natural uso en el uso que es contra naturaleza:
Y como á ellos no les pareció tener á Dios en su noticia, Dios los entregó á una mente depravada, para hacer lo que no conviene,
Estando atestados de toda iniquidad, de fornicación, de malicia, de avaricia, de maldad; llenos de envidia, de homicidios, de contiendas, de engaños, de malignidades;
Murmuradores, detractores, aborrecedores de Dios, injuriosos, soberbios, altivos, inventores de males, desobedientes á los padres,
Necios, desleales, sin afecto natural, implacables, sin misericordia:
Que, habiendo entendido el juicio de Dios que los que hacen tales cosas son dignos de muerte, no sólo las hacen, mas aun consienten á los que las hacen.
POR lo cual eres inexcusable, oh hombre, cualquiera que juzgas: porque en lo que juzgas á otro, te condenas á ti mismo; porque lo mismo haces, tú que juzgas.
Mas sabemos que el juicio de Dios es según verdad contra los que hacen tales cosas.
¿Y piensas esto, oh hombre, que juzgas á los que hacen tales cosas, y haces las mismas, que tú escaparás del juicio de Dios?
¿O menosprecias las riquezas de su benignidad, y paciencia, y longanimidad, ignorando que su benignidad te guía á arrepentimiento?
Mas por tu dureza, y por tu corazón no arrepentido, atesoras para ti mismo ira para el día de la ira y de la manifestación del justo juicio de Dios;
El cual pagará á cada uno conforme á sus obras:
A los que perseverando en bien hacer, buscan gloria y honra é inmortalidad, la vida eterna.
Mas á los que son contenciosos, y no obedecen á la verdad, antes obedecen á la injusticia, enojo é ira;
Tribulación y angustia sobre toda persona humana que obra lo malo, el Judío primeramente, y también el Griego:
Mas gloria y honra y paz á cualquiera que obra el bien, al Judío primeramente, y también al Griego.
Porque no hay acepción de personas para con Dios.
Porque todos los que sin ley pecaron, sin ley también perecerán; y todos los que en la ley pecaron, por la ley serán juzgados:
Porque no los oidores de la ley son justos para con Dios, mas los hacedores de la ley serán justificados.
Porque los Gentiles que no tienen ley, naturalmente haciendo lo que es de la ley, los tales, aunque no tengan ley, ellos son ley á sí mismos:
Mostrando la obra de la ley escrita en sus corazones, dando testimonio juntamente sus conciencias, y acusándose y también excusándose sus pensamientos unos con otros;
En el día que juzgará el Señor lo encubierto de los hombres, conforme á mi evangelio, por Jesucristo.
He aquí, tú tienes el sobrenombre de Judío, y estás reposado en la ley, y te glorías en Dios,
Y sabes su voluntad, y apruebas lo mejor, instruído por la ley;
Y confías que eres guía de los ciegos, luz de los que están en tinieblas,
Enseñador de los que no saben, maestro de niños, que tienes la forma de la ciencia y de la verdad en la ley:
Tú pues, que enseñas á otro, ¿no te enseñas á ti mismo? ¿Tú, que predicas que no se ha de hurtar, hurtas?
¿Tú, que dices que no se ha de adulterar, adulteras? ¿Tú, que abominas los ídolos, cometes sacrilegio?
¿Tú, que te jactas de la ley, con infracción de la ley deshonras á Dios?
Porque el nombre de Dios es blasfemado por causa de vosotros entre los Gentiles, como está escrito.
Porque la circuncisión en verdad aprovecha, si guardares la ley; mas si eres rebelde á la ley, tu circuncisión es hecha incircuncisión.
De manera que, si el incircunciso guardare las justicias de la ley, ¿no será tenida su incircuncisión por circuncisión?
Y lo que de su natural es incircunciso, guardando perfectamente la ley, te juzgará á ti, que con la letra y con la circuncisión eres rebelde á la ley.
Porque no es Judío el que lo es en manifiesto; ni la circuncisión es la que es en manifiesto en la carne:
Mas es Judío el que lo es en lo interior; y la circuncisión es la del corazón, en espíritu, no en letra; la alabanza del cual no es de los hombres, sino de Dios.
¿QUÉ, pues, tiene más el Judío? ¿ó qué aprovecha la circuncisión?
Mucho en todas maneras. Lo primero ciertamente, que la palabra de Dios les ha sido confiada.
¿Pues qué si algunos de ellos han sido incrédulos? ¿la incredulidad de ellos habrá hecho vana la verdad de Dios?
En ninguna manera; antes bien sea Dios verdadero, mas todo hombre mentiroso; como está escrito: Para que seas justificado en tus dichos, y venzas cuando de ti se juzgare.
Y si nuestra iniquidad encarece la justicia de Dios, ¿qué diremos? ¿Será injusto Dios que da castigo? (hablo como hombre.)
En ninguna manera: de otra suerte ¿cómo juzgaría Dios el mundo?
Empero si la verdad de Dios por mi mentira creció á gloria suya, ¿por qué aun así yo soy juzgado como pecador?
¿Y por qué no decir (como somos blasfemados, y como algunos dicen que nosotros decimos): Hagamos males para que vengan bienes? la condenación de los cuales es justa.
¿Qué pues? ¿Somos mejores que ellos? En ninguna manera: porque ya hemos acusado á Judíos y á Gentiles, que todos están debajo de pecado.
Como está escrito: No hay justo, ni aun uno;
No hay quien entienda, no hay quien busque á Dios;
Todos se apartaron, á una fueron hechos inútiles; no hay quien haga lo bueno, no hay ni aun uno:
Sepulcro abierto es su garganta; con sus lenguas tratan engañosamente; veneno de áspides está debajo de sus labios;
Cuya boca está llena de maledicencia y de amargura;
Sus pies son ligeros á derramar sangre;
Quebrantamiento y desventura hay en sus caminos;
Y camino de paz no conocieron:
No hay temor de Dios delante de sus ojos.
Empero sabemos que todo lo que la ley dice, á los que están en la ley lo dice, para que toda boca se tape, y que todo el mundo se sujete á Dios:
Porque por las obras de la ley ninguna carne se justificará delante de él; porque por la ley es el conocimiento del pecado.
Mas ahora, sin la ley, la justicia de Dios se ha manifestado, testificada por la ley y por los profetas:
La justicia de Dios por la fe de Jesucristo, para todos los que creen en él; porque no hay diferencia;
Por cuanto todos pecaron, y están destituídos de la gloria de Dios;
Siendo justificados gratuitamente por su gracia, por la redención que es en Cristo Jesús;
Al cual Dios ha propuesto en propiciación por la fe en su sangre, para manifestación de su justicia, atento á haber pasado por alto, en su paciencia, los pecados pasados,
Con la mira de manifestar su justicia en este tiempo: para que él sea el justo, y el que justifica al que es de la fe de Jesús.
¿Dónde pues está la jactancia? Es excluída. ¿Por cuál ley? ¿de las obras? No; mas por la ley de la fe.
Así que, concluímos ser el hombre justificado por fe sin las obras de la ley.
¿Es Dios solamente Dios de los Judíos? ¿No es también Dios de los Gentiles? Cierto, también de los Gentiles.
Porque uno es Dios, el cual justificará por la fe la circuncisión, y por medio de la fe la incircuncisión.
¿Luego deshacemos la ley por la fe? En ninguna manera; antes establecemos la ley.
¿QUÉ, pues, diremos que halló Abraham nuestro padre según la carne?
Que si Abraham fué justificado por la obras, tiene de qué gloriarse; mas no para con Dios.
Porque ¿qué dice la Escritura? Y creyó Abraham á Dios, y le fué atribuído á justicia.
Empero al que obra, no se le cuenta el salario por merced, sino por deuda.
Mas al que no obra, pero cree en aquél que justifica al impío, la fe le es contada por justicia.
Como también David dice ser bienaventurado el hombre al cual Dios atribuye justicia sin obras,
Diciendo: Bienaventurados aquellos cuyas iniquidades son perdonadas, y cuyos pecados son cubiertos.
Bienaventurado el varón al cual el Señor no imputó pecado.
¿Es pues esta bienaventuranza solamente en la circuncisión, ó también en la incircuncisión? porque decimos que á Abraham fué contada la fe por justicia.
¿Cómo pues le fué contada? ¿en la circuncisión, ó en la incircuncisión? No en la circuncisión, sino en la incircuncisión.
Y padre de la circuncisión, no solamente á los que son de la circuncisión, mas también á los que siguen las pisadas de la fe que fué en nuestro padre Abraham antes de ser circuncidado.
Porque no por la ley fué dada la promesa á Abraham ó á su simiente, que sería heredero del mundo, sino por la justicia de la fe.
Porque si los que son de la ley son los herederos, vana es la fe, y anulada es la promesa.
Porque la ley obra ira; porque donde no hay ley, tampoco hay transgresión.
(Como está escrito: Que por padre de muchas gentes te he puesto) delante de Dios, al cual creyó; el cual da vida á los muertos, y llama las cosas que no son, como las que son.
El creyó en esperanza contra esperanza, para venir á ser padre de muchas gentes, conforme á lo que le había sido dicho: Así será tu simiente.
Y no se enflaqueció en la fe, ni consideró su cuerpo ya muerto (siendo ya de casi cien años), ni la matriz muerta de Sara;
Tampoco en la promesa de Dios dudó con desconfianza: antes fué esforzado en fe, dando gloria á Dios,
Plenamente convencido de que todo lo que había prometido, era también poderoso para hacerlo.
Por lo cual también le fué atribuído á justicia.
Y no solamente por él fué escrito que le haya sido imputado;
Sino también por nosotros, á quienes será imputado, esto es, á los que creemos en el que levantó de los muertos á Jesús Señor nuestro,
El cual fué entregado por nuestros delitos, y resucitado para nuestra justificación.
JUSTIFICADOS pues por la fe, tenemos paz para con Dios por medio de nuestro Señor Jesucristo:
Por el cual también tenemos entrada por la fe á esta gracia en la cual estamosfirmes, y nos gloriamos en la esperanza de la gloria de Dios.
Y no sólo esto, mas aun nos gloriamos en las tribulaciones, sabiendo que la tribulación produce paciencia;
Y la paciencia, prueba; y la prueba, esperanza;
Y la esperanza no avergüenza; porque el amor de Dios está derramado en nuestros corazones por el Espíritu Santo que nos es dado.
Porque Cristo, cuando aun éramos flacos, á su tiempo murió por los impíos.
Ciertamente apenas muere alguno por un justo: con todo podrá ser que alguno osara morir por el bueno.
Mas Dios encarece su caridad para con nosotros, porque siendo aún pecadores, Cristo murió por nosotros.
Luego mucho más ahora, justificados en su sangre, por él seremos salvos de la ira.
Porque si siendo enemigos, fuimos reconciliados con Dios por la muerte de su Hijo, mucho más, estando reconciliados, seremos salvos por su vida.
Y no sólo esto, mas aun nos gloriamos en Dios por el Señor nuestro Jesucristo, por el cual hemos ahora recibido la reconciliación.
De consiguiente, vino la reconciliación por uno, así como el pecado entró en el mundo por un hombre, y por el pecado la muerte, y la muerte así pasó á todos los hombres, pues que todos pecaron.
Porque hasta la ley, el pecado estaba en el mundo; pero no se imputa pecado no habiendo ley.
No obstante, reinó la muerte desde Adam hasta Moisés, aun en los que no pecaron á la manera de la rebelión de Adam; el cual es figura del que había de venir.
Mas no como el delito, tal fué el don: porque si por el delito de aquel uno murieron los muchos, mucho más abundó la gracia de Dios á los muchos, y el don por la gracia de un hombre, Jesucristo.
Ni tampoco de la manera que por un pecado, así también el don: porque el juicio á la verdad vino de un pecado para condenación, mas la gracia vino de muchos delitos para justificación.
Así que, de la manera que por un delito vino la culpa á todos los hombres para condenación, así por una justicia vino la gracia á todos los hombres para justificación de vida.
Porque como por la desobediencia de un hombre los muchos fueron constituídos pecadores, así por la obediencia de uno los muchos serán constituídos justos.
La ley empero entró para que el pecado creciese; mas cuando el pecado creció, sobrepujó la gracia;
Para que, de la manera que el pecado reinó para muerte, así también la gracia reine por la justicia para vida eterna por Jesucristo Señor nuestro.
¿PUES qué diremos? Perseveraremos en pecado para que la gracia crezca?
En ninguna manera. Porque los que somos muertos al pecado, ¿cómo viviremos aún en él?
¿O no sabéis que todos los que somos bautizados en Cristo Jesús, somos bautizados en su muerte?
Porque somos sepultados juntamente con él á muerte por el bautismo; para que como Cristo resucitó de los muertos por la gloria del Padre, así también nosotros andemos en novedad de vida.
Porque si fuimos plantados juntamente en él á la semejanza de su muerte, así también lo seremos á la de su resurrección:
Sabiendo esto, que nuestro viejo hombre juntamente fué crucificado con él, para que el cuerpo del pecado sea deshecho, á fin de que no sirvamos más al pecado.
Porque el que es muerto, justificado es del pecado.
Y si morimos con Cristo, creemos que también viviremos con él;
Sabiendo que Cristo, habiendo resucitado de entre los muertos, ya no muere: la muerte no se enseñoreará más de él.
Porque el haber muerto, al pecado murió una vez; mas el vivir, á Dios vive.
Así también vosotros, pensad que de cierto estáis muertos al pecado, mas vivos á Dios en Cristo Jesús Señor nuestro.
No reine, pues, el pecado en vuestro cuerpo mortal, para que le obedezcáis en sus concupiscencias;
Ni tampoco presentéis vuestros miembros al pecado por instrumentos de iniquidad; antes presentaos á Dios como vivos de los muertos, y vuestros miembros á Dios por instrumentos de justicia.
Porque el pecado no se enseñoreará de vosotros; pues no estáis bajo la ley, sino bajo la gracia.
¿Pues qué? ¿Pecaremos, porque no estamos bajo de la ley, sino bajo de la gracia? En ninguna manera.
¿No sabéis que á quien os prestáis vosotros mismos por siervos para obedecerle, sois siervos de aquel á quien obedecéis, ó del pecado para muerte, ó de la obediencia para justicia?
Empero gracias á Dios, que aunque fuisteis siervos del pecado, habéis obedecido de corazón á aquella forma de doctrina á la cual sois entregados;
Y libertados del pecado, sois hechos siervos de la justicia.
Porque cuando fuisteis siervos del pecado, erais libres acerca de la justicia.
¿Qué fruto, pues, teníais de aquellas cosas de las cuales ahora os avergonzáis? porque el fin de ellas es muerte.
Mas ahora, librados del pecado, y hechos siervos á Dios, tenéis por vuestro fruto la santificación, y por fin la vida eterna.
Porque la paga del pecado es muerte: mas la dádiva de Dios es vida eterna en Cristo Jesús Señor nuestro.
¿IGNORÁIS, hermanos, (porque hablo con los que saben la ley) que la ley se enseñorea del hombre entre tanto que vive?
Porque la mujer que está sujeta á marido, mientras el marido vive está obligada á la ley; mas muerto el marido, libre es de la ley del marido.
Así también vosotros, hermanos míos, estáis muertos á la ley por el cuerpo de Cristo, para que seáis de otro, á saber, del que resucitó de los muertos, á fin de que fructifiquemos á Dios.
Porque mientras estábamos en la carne, los afectos de los pecados que eran por la ley, obraban en nuestros miembros fructificando para muerte.
Mas ahora estamos libres de la ley, habiendo muerto á aquella en la cual estábamos detenidos, para que sirvamos en novedad de espíritu, y no en vejez de letra.
¿Qué pues diremos? ¿La ley es pecado? En ninguna manera. Empero yo no conocí el pecado sino por la ley: porque tampoco conociera la concupiscencia, si la ley no dijera: No codiciarás.
Mas el pecado, tomando ocasión, obró en mí por el mandamiento toda concupiscencia: porque sin la ley el pecado está muerto.
Así que, yo sin la ley vivía por algún tiempo: mas venido el mandamiento, el pecado revivió, y yo morí.
Y hallé que el mandamiento, intimado para vida, para mí era mortal:
Porque el pecado, tomando ocasión, me engañó por el mandamiento, y por él me mató.
De manera que la ley á la verdad es santa, y el mandamiento santo, y justo, y bueno.
Porque sabemos que la ley es espiritual; mas yo soy carnal, vendido á sujeción del pecado.
Porque lo que hago, no lo entiendo; ni lo que quiero, hago; antes lo que aborrezco, aquello hago.
Y si lo que no quiero, esto hago, apruebo que la ley es buena.
De manera que ya no obro aquello, sino el pecado que mora en mí.
Y yo sé que en mí (es á saber, en mi carne) no mora el bien: porque tengo el querer, mas efectuar el bien no lo alcanzo.
Porque no hago el bien que quiero; mas el mal que no quiero, éste hago.
Y si hago lo que no quiero, ya no lo obro yo, sino el pecado que mora en mí.
Así que, queriendo yo hacer el bien, hallo esta ley: Que el mal está en mí.
Porque según el hombre interior, me deleito en la ley de Dios:
Mas veo otra ley en mis miembros, que se rebela contra la ley de mi espíritu, y que me lleva cautivo á la ley del pecado que está en mis miembros.
¡Miserable hombre de mí! ¿quién me librará del cuerpo de esta muerte?
Gracias doy á Dios, por Jesucristo Señor nuestro. Así que, yo mismo con la mente sirvo á la ley de Dios, mas con la carne á la ley del pecado.
AHORA pues, ninguna condenación hay para los que están en Cristo Jesús, los que no andan conforme á la carne, mas conforme al espíritu.
Porque la ley del Espíritu de vida en Cristo Jesús me ha librado de la ley del pecado y de la muerte.
Porque lo que era imposible á la ley, por cuanto era débil por la carne, Dios enviando á su Hijo en semejanza de carne de pecado, y á causa del pecado, condenó al pecado en la carne;
Para que la justicia de la ley fuese cumplida en nosotros, que no andamos conforme á la carne, mas conforme al espíritu.
Porque los que viven conforme á la carne, de las cosas que son de la carne se ocupan; mas los que conforme al espíritu, de las cosas del espíritu.
Porque la intención de la carne es muerte; mas la intención del espíritu, vida y paz:
Por cuanto la intención de la carne es enemistad contra Dios; porque no se sujeta á la ley de Dios, ni tampoco puede.
Así que, los que están en la carne no pueden agradar á Dios.
Mas vosotros no estáis en la carne, sino en el espíritu, si es que el Espíritu de Dios mora en vosotros. Y si alguno no tiene el Espíritu de Cristo, el tal no es de él.
Empero si Cristo está en vosotros, el cuerpo á la verdad está muerto á causa del pecado; mas el espíritu vive á causa de la justicia.
Así que, hermanos, deudores somos, no á la carne, para que vivamos conforme á la carne:
Porque si viviereis conforme á la carne, moriréis; mas si por el espíritu mortificáis las obras de la carne, viviréis.
Porque todos los que son guiados por el Espíritu de Dios, los tales son hijos de Dios.
Porque no habéis recibido el espíritu de servidumbre para estar otra vez en temor; mas habéis recibido el espíritu de adopción, por el cual clamamos, Abba, Padre.
Porque el mismo Espíritu da testimonio á nuestro espíritu que somos hijos de Dios.
Y si hijos, también herederos; herederos de Dios, y coherederos de Cristo; si empero padecemos juntamente con él, para que juntamente con él seamos glorificados.
Porque tengo por cierto que lo que en este tiempo se padece, no es de comparar con la gloria venidera que en nosotros ha de ser manifestada.
Porque el continuo anhelar de las criaturas espera la manifestación de los hijos de Dios.
Porque las criaturas sujetas fueron á vanidad, no de grado, mas por causa del que las sujetó con esperanza,
Que también las mismas criaturas serán libradas de la servidumbre de corrupción en la libertad gloriosa de los hijos de Dios.
Porque sabemos que todas las criaturas gimen á una, y á una están de parto hasta ahora.
Porque en esperanza somos salvos; mas la esperanza que se ve, no es esperanza; porque lo que alguno ve, ¿á qué esperarlo?
Empero si lo que no vemos esperamos, por paciencia esperamos.
Y asimismo también el Espíritu ayuda nuestra flaqueza: porque qué hemos de pedir como conviene, no lo sabemos; sino que el mismo Espíritu pide por nosotros con gemidos indecibles.
Mas el que escudriña los corazones, sabe cuál es el intento del Espíritu, porque conforme á la voluntad de Dios, demanda por los santos.
Y sabemos que á los que á Dios aman, todas las cosas les ayudan á bien, es á saber, á los que conforme al propósito son llamados.
Porque á los que antes conoció, también predestinó para que fuesen hechos conformes á la imagen de su Hijo, para que él sea el primogénito entre muchos hermanos;
Y á los que predestinó, á éstos también llamó; y á los que llamó, á éstos también justificó; y á los que justificó, á éstos también glorificó.
¿Pues qué diremos á esto? Si Dios por nosotros, ¿quién contra nosotros?
El que aun á su propio Hijo no perdonó, antes le entregó por todos nosotros, ¿cómo no nos dará también con él todas las cosas?
¿Quién acusará á los escogidos de Dios? Dios es el que justifica.
¿Quién es el que condenará? Cristo es el que murió; más aún, el que también resucitó, quien además está á la diestra de Dios, el que también intercede por nosotros.
¿Quién nos apartará del amor de Cristo? tribulación? ó angustia? ó persecución? ó hambre? ó desnudez? ó peligro? ó cuchillo?
Como está escrito: Por causa de ti somos muertos todo el tiempo: somos estimados como ovejas de matadero.
Antes, en todas estas cosas hacemos más que vencer por medio de aquel que nos amó.
Por lo cual estoy cierto que ni la muerte, ni la vida, ni ángeles, ni principados, ni potestades, ni lo presente, ni lo por venir,
Ni lo alto, ni lo bajo, ni ninguna criatura nos podrá apartar del amor de Dios, que es en Cristo Jesús Señor nuestro.
VERDAD digo en Cristo, no miento, dándome testimonio mi conciencia en el Espíritu Santo,
Que tengo gran tristeza y continuo dolor en mi corazón.
Porque deseara yo mismo ser apartado de Cristo por mis hermanos, los que son mis parientes según la carne;
Que son israelitas, de los cuales es la adopción, y la gloria, y el pacto, y la data de la ley, y el culto, y las promesas;
Cuyos son los padres, y de los cuales es Cristo según la carne, el cual es Dios sobre todas las cosas, bendito por los siglos. Amén.
No empero que la palabra de Dios haya faltado: porque no todos los que son de Israel son Israelitas;
Ni por ser simiente de Abraham, son todos hijos; mas: En Isaac te será llamada simiente.
Quiere decir: No los que son hijos de la carne, éstos son los hijos de Dios; mas los que son hijos de la promesa, son contados en la generación.
Porque la palabra de la promesa es esta: Como en este tiempo vendré, y tendrá Sara un hijo.
Y no sólo esto; mas también Rebeca concibiendo de uno, de Isaac nuestro padre,
(Porque no siendo aún nacidos, ni habiendo hecho aún ni bien ni mal, para que el propósito de Dios conforme á la elección, no por las obras sino por el que llama, permaneciese;)
Le fué dicho que el mayor serviría al menor.
Como está escrito: A Jacob amé, mas á Esaú aborrecí.
¿Pues qué diremos? ¿Que hay injusticia en Dios? En ninguna manera.
Mas á Moisés dice: Tendré misericordia del que tendré misericordia, y me compadeceré del que me compadeceré.
Así que no es del que quiere, ni del que corre, sino de Dios que tiene misericordia.
Porque la Escritura dice de Faraón: Que para esto mismo te he levantado, para mostrar en ti mi potencia, y que mi nombre sea anunciado por toda la tierra.
De manera que del que quiere tiene misericordia; y al que quiere, endurece.
Me dirás pues: ¿Por qué, pues, se enoja? porque ¿quién resistirá á su voluntad?
Mas antes, oh hombre, ¿quién eres tú, para que alterques con Dios? Dirá el vaso de barro al que le labró: ¿Por qué me has hecho tal?
¿O no tiene potestad el alfarero para hacer de la misma masa un vaso para honra, y otro para vergüenza?
¿Y qué, si Dios, queriendo mostrar la ira y hacer notoria su potencia, soportó con mucha mansedumbre los vasos de ira preparados para muerte,
Y para hacer notorias las riquezas de su gloria, mostrólas para con los vasos de misericordia que él ha preparado para gloria;
Los cuales también ha llamado, es á saber, á nosotros, no sólo de los Judíos, mas también de los Gentiles?
Como también en Oseas dice: Llamaré al que no era mi pueblo, pueblo mío; y á la no amada, amada.
Y será, que en el lugar donde les fué dicho: Vosotros no sois pueblo mío: allí serán llamados hijos del Dios viviente.
También Isaías clama tocante á Israel: Si fuere el número de los hijos de Israel como la arena de la mar, las reliquias serán salvas:
Porque palabra consumadora y abreviadora en justicia, porque palabra abreviada, hará el Señor sobre la tierra.
Y como antes dijo Isaías: Si el Señor de los ejércitos no nos hubiera dejado simiente, como Sodoma habríamos venido á ser, y á Gomorra fuéramos semejantes.
¿Pues qué diremos? Que los Gentiles que no seguían justicia, han alcanzado la justicia, es á saber, la justicia que es por la fe;
Mas Israel que seguía la ley de justicia, no ha llegado á la ley de justicia.
¿Por qué? Porque la seguían no por fe, mas como por las obras de la ley: por lo cual tropezaron en la piedra de tropiezo,
Como está escrito: He aquí pongo en Sión piedra de tropiezo, y piedra de caída; y aquel que creyere en ella, no será avergonzado.
HERMANOS, ciertamente la voluntad de mi corazón y mi oración á Dios sobre Israel, es para salud.
Porque yo les doy testimonio que tienen celo de Dios, mas no conforme á ciencia.
Porque ignorando la justicia de Dios, y procurando establecer la suya propia, no se han sujetado á la justicia de Dios.
Porque el fin de la ley es Cristo, para justicia á todo aquel que cree.
Porque Moisés describe la justicia que es por la ley: Que el hombre que hiciere estas cosas, vivirá por ellas.
Mas la justicia que es por la fe dice así: No digas en tu corazón: ¿Quién subirá al cielo? (esto es, para traer abajo á Cristo:)
O, ¿quién descenderá al abismo? (esto es, para volver á traer á Cristo de los muertos.)
Mas ¿qué dice? Cercana está la palabra, en tu boca y en tu corazón. Esta es la palabra de fe, la cual predicamos:
Que si confesares con tu boca al Señor Jesús, y creyeres en tu corazón que Dios le levantó de los muertos, serás salvo.
Porque con el corazón se cree para justicia; mas con la boca se hace confesión para salud.
Porque la Escritura dice: Todo aquel que en él creyere, no será avergonzado.
Porque no hay diferencia de Judío y de Griego: porque el mismo que es Señor de todos, rico es para con todos los que le invocan:
Porque todo aquel que invocare el nombre del Señor, será salvo.
¿Cómo, pues invocarán á aquel en el cual no han creído? ¿y cómo creerán á aquel de quien no han oído? ¿y cómo oirán sin haber quien les predique?
¿Y cómo predicarán si no fueren enviados? Como está escrito: ¡Cuán hermosos son los pies de los que anuncian el evangelio de la paz, de los que anuncian el evangelio de los bienes!
Mas no todos obedecen al evangelio; pues Isaías dice: Señor, ¿quién ha creído á nuestro anuncio?
Luego la fe es por el oir; y el oir por la palabra de Dios.
Mas digo: ¿No han oído? Antes bien, por toda la tierra ha salido la fama de ellos, y hasta los cabos de la redondez de la tierra las palabras de ellos.
Mas digo: ¿No ha conocido esto Israel? Primeramente Moisés dice: Yo os provocaré á celos con gente que no es mía; con gente insensata os provocaré á ira.
E Isaías determinadamente dice: Fuí hallado de los que no me buscaban; manifestéme á los que no preguntaban por mí.
Mas acerca de Israel dice: Todo el día extendí mis manos á un pueblo rebelde y contradictor.
DIGO pues: ¿Ha desechado Dios á su pueblo? En ninguna manera. Porque también yo soy Israelita, de la simiente de Abraham, de la tribu de Benjamín.
No ha desechado Dios á su pueblo, al cual antes conoció. ¿O no sabéis qué dice de Elías la Escritura? cómo hablando con Dios contra Israel dice:
Señor, á tus profetas han muerto, y tus altares han derruído; y yo he quedado solo, y procuran matarme.
Mas ¿qué le dice la divina respuesta? He dejado para mí siete mil hombres, que no han doblado la rodilla delante de Baal.
Así también, aun en este tiempo han quedado reliquias por la elección de gracia.
Y si por gracia, luego no por las obras; de otra manera la gracia ya no es gracia. Y si por las obras, ya no es gracia; de otra manera la obra ya no es obra.
¿Qué pues? Lo que buscaba Israel aquello no ha alcanzado; mas la elección lo ha alcanzado: y los demás fueron endurecidos;
Como está escrito: Dióles Dios espíritu de remordimiento, ojos con que no vean, y oídos con que no oigan, hasta el día de hoy.
Y David dice: Séales vuelta su mesa en lazo, y en red, y en tropezadero, y en paga:
Sus ojos sean obscurecidos para que no vean, y agóbiales siempre el espinazo.
Digo pues: ¿Han tropezado para que cayesen? En ninguna manera; mas por el tropiezo de ellos vino la salud á los Gentiles, para que fuesen provocados á celos.
Y si la falta de ellos es la riqueza del mundo, y el menoscabo de ellos la riqueza de los Gentiles, ¿cuánto más el henchimiento de ellos?
Porque á vosotros hablo, Gentiles. Por cuanto pues, yo soy apóstol de los Gentiles, mi ministerio honro,
Por si en alguna manera provocase á celos á mi carne, é hiciese salvos á algunos de ellos.
Porque si el extrañamiento de ellos es la reconciliación del mundo, ¿qué será el recibimiento de ellos, sino vida de los muertos?
Y si el primer fruto es santo, también lo es el todo, y si la raíz es santa, también lo son las ramas.
Que si algunas de las ramas fueron quebradas, y tú, siendo acebuche, has sido ingerido en lugar de ellas, y has sido hecho participante de la raíz y de la grosura de la oliva;
No te jactes contra las ramas; y si te jactas, sabe que no sustentas tú á la raíz, sino la raíz á ti.
Pues las ramas, dirás, fueron quebradas para que yo fuese ingerido.
Bien: por su incredulidad fueron quebradas, mas tú por la fe estás en pie. No te ensoberbezcas, antes teme,
Que si Dios no perdonó á las ramas naturales, á ti tampoco no perdone.
Mira, pues, la bondad y la severidad de Dios: la severidad ciertamente en los que cayeron; mas la bondad para contigo, si permanecieres en la bondad; pues de otra manera tú también serás cortado.
Y aun ellos, si no permanecieren en incredulidad, serán ingeridos; que poderoso es Dios para volverlos á ingerir.
Y luego todo Israel será salvo; como está escrito: Vendrá de Sión el Libertador, que quitará de Jacob la impiedad;
Y este es mi pacto con ellos, cuando quitare su pecados.
Así que, cuanto al evangelio, son enemigos por causa de vosotros: mas cuanto á la elección, son muy amados por causa de los padres.
Porque sin arrepentimiento son las mercedes y la vocación de Dios.
Porque como también vosotros en algún tiempo no creísteis á Dios, mas ahora habéis alcanzado misericordia por la incredulidad de ellos;
Así también éstos ahora no han creído, para que, por la misericordia para con vosotros, ellos también alcancen misericordia.
Porque Dios encerró á todos en incredulidad, para tener misericordia de todos.
¡Oh profundidad de las riquezas de la sabiduría y de la ciencia de Dios! ¡Cuán incomprensibles son sus juicios, é inescrutables sus caminos!
Porque ¿quién entendió la mente del Señor? ¿ó quién fué su consejero?
¿O quién le dió á él primero, para que le sea pagado?
Porque de él, y por él, y en él, son todas las cosas. A él sea gloria por siglos. Amén.
ASÍ que, hermanos, os ruego por las misericordias de Dios, que presentéis vuestros cuerpos en sacrificio vivo, santo, agradable á Dios, que esvuestro racional culto.
Y no os conforméis á este siglo; mas reformaos por la renovación de vuestro entendimiento, para que experimentéis cuál sea la buena voluntad de Dios, agradable y perfecta.
Porque de la manera que en un cuerpo tenemos muchos miembros, empero todos los miembros no tienen la misma operación;
Así muchos somos un cuerpo en Cristo, mas todos miembros los unos de los otros.
De manera que, teniendo diferentes dones según la gracia que nos es dada, si el de profecía, úsese conforme á la medida de la fe;
O si ministerio, en servir; ó el que enseña, en doctrina;
El que exhorta, en exhortar; el que reparte, hágalo en simplicidad; el que preside, con solicitud; el que hace misericordia, con alegría.
El amor sea sin fingimiento: aborreciendo lo malo, llegándoos á lo bueno;
Amándoos los unos á los otros con caridad fraternal; previniéndoos con honra los unos á los otros;
En el cuidado no perezosos; ardientes en espíritu; sirviendo al Señor;
Gozosos en la esperanza; sufridos en la tribulación; constantes en la oración;
Comunicando á las necesidades de los santos; siguiendo la hospitalidad.
Bendecid á los que os persiguen: bendecid, y no maldigáis.
Gozaos con los que se gozan: llorad con los que lloran.
Unánimes entre vosotros: no altivos, mas acomodándoos á los humildes. No seáis sabios en vuestra opinión.
No paguéis á nadie mal por mal; procurad lo bueno delante de todos los hombres.
Si se puede hacer, cuanto está en vosotros, tened paz con todos los hombres.
No os venguéis vosotros mismos, amados míos; antes dad lugar á la ira; porque escrito está: Mía es la venganza: yo pagaré, dice el Señor.
Así que, si tu enemigo tuviere hambre, dale de comer; si tuviere sed, dale de beber: que haciendo esto, ascuas de fuego amontonas sobre su cabeza.
No seas vencido de lo malo; mas vence con el bien el mal.
TODA alma se someta á las potestades superiores; porque no hay potestad sino de Dios; y las que son, de Dios son ordenadas.
Así que, el que se opone á la potestad, á la ordenación de Dios resiste: y los que resisten, ellos mismos ganan condenación para sí.
Porque los magistrados no son para temor al que bien hace, sino al malo. ¿Quieres pues no temer la potestad? haz lo bueno, y tendrás alabanza de ella;
Porque es ministro de Dios para tu bien. Mas si hicieres lo malo, teme: porque no en vano lleva el cuchillo; porque es ministro de Dios, vengador para castigo al que hace lo malo.
Por lo cual es necesario que le estéis sujetos, no solamente por la ira, mas aun por la conciencia.
Porque por esto pagáis también los tributos; porque son ministros de Dios que sirven á esto mismo.
Pagad á todos lo que debéis: al que tributo, tributo; al que pecho, pecho; al que temor, temor; al que honra, honra.
No debáis á nadie nada, sino amaros unos á otros; porque el que ama al prójimo, cumplió la ley.
La caridad no hace mal al prójimo: así que, el cumplimento de la ley es la caridad.
Y esto, conociendo el tiempo, que es ya hora de levantarnos del sueño; porque ahora nos está más cerca nuestra salud que cuando creímos.
La noche ha pasado, y ha llegado el día: echemos, pues, las obras de las tinieblas, y vistámonos las armas de luz.
Andemos como de día, honestamente: no en glotonerías y borracheras, no en lechos y disoluciones, no en pedencias y envidia:
Mas vestíos del Señor Jesucristo, y no hagáis caso de la carne en sus deseos.
RECIBID al flaco en la fe, perono para contiendas de disputas.
Porque uno cree que se ha de comer de todas cosas: otro que es débil, come legumbres.
El que come, no menosprecie al que no come: y el que no come, no juzgue al que come; porque Dios le ha levantado.
¿Tú quién eres que juzgas al siervo ajeno? para su señor está en pie, ó cae: mas se afirmará; que poderoso es el Señor para afirmarle.
Uno hace diferencia entre día y día; otro juzga iguales todos los días. Cada uno esté asegurado en su ánimo.
Porque ninguno de nosotros vive para sí, y ninguno muere para sí.
Que si vivimos, para el Señor vivimos; y si morimos, para el Señor morimos. Así que, ó que vivamos, ó que muramos, del Señor somos.
Porque Cristo para esto murió, y resucitó, y volvió á vivir, para ser Señor así de los muertos como de los que viven.
Mas tú ¿por qué juzgas á tu hermano? ó tú también, ¿por qué menosprecias á tu hermano? porque todos hemos de estar ante el tribunal de Cristo.
Porque escrito está: Vivo yo, dice el Señor, que á mí se doblará toda rodilla, y toda lengua confesará á Dios.
De manera que, cada uno de nosotros dará á Dios razón de sí.
Así que, no juzguemos más los unos de los otros: antes bien juzgad de no poner tropiezo ó escándalo al hermano.
Yo sé, y confío en el Señor Jesús, que de suyo nada hay inmundo: mas á aquel que piensa alguna cosa ser inmunda, para él es inmunda.
Empero si por causa de la comida tu hermano es contristado, ya no andas conforme á la caridad. No arruines con tu comida á aquél por el cual Cristo murió.
No sea pues blasfemado vuestro bien:
Que el reino de Dios no es comida ni bebida, sino justicia y paz y gozo por el Espíritu Santo.
Porque el que en esto sirve á Cristo, agrada á Dios, y es acepto á los hombres.
Así que, sigamos lo que hace á la paz, y á la edificación de los unos á los otros.
No destruyas la obra de Dios por causa de la comida. Todas las cosas á la verdad son limpias: mas malo es al hombre que come con escándalo.
Bueno es no comer carne, ni beber vino, ni nada en que tu hermano tropiece, ó se ofenda, ó sea debilitado.
¿Tienes tú fe? Tenla para contigo delante de Dios. Bienaventurado el que no se condena á sí mismo con lo que aprueba.
ASÍ que, los que somos más firmes debemos sobrellevar las flaquezas de los flacos, y no agradarnos á nosotros mismos.
Cada uno de nosotros agrade á su prójimo en bien, á edificación.
Porque Cristo no se agradó á sí mismo; antes bien, como está escrito: Los vituperios de los que te vituperan, cayeron sobre mí.
Porque las cosas que antes fueron escritas, para nuestra enseñanza fueron escritas; para que por la paciencia, y por la consolación de las Escrituras, tengamos esperanza.
Mas el Dios de la paciencia y de la consolación os dé que entre vosotros seáis unánimes según Cristo Jesús;
Para que concordes, á una boca glorifiquéis al Dios y Padre de nuestro Señor Jesucristo.
Por tanto, sobrellevaos los unos á los otros, como también Cristo nos sobrellevó, para gloria de Dios.
Digo, pues, que Cristo Jesús fué hecho ministro de la circuncisión por la verdad de Dios, para confirmar las promesas hechas á los padres,
Y para que los Gentiles glorifiquen á Dios por la misericordia; como está escrito: Por tanto yo te confesaré entre los Gentiles, y cantaré á tu nombre.
Y otra vez dice: Alegraos, Gentiles, con su pueblo.
Y otra vez: Alabad al Señor todos los Gentiles, y magnificadle, todos los pueblos.
Y otra vez, dice Isaías: Estará la raíz de Jessé, y el que se levantará á regir los Gentiles: los Gentiles esperarán en él.
Y el Dios de esperanza os llene de todo gozo y paz creyendo, para que abundéis en esperanza por la virtud del Espíritu Santo.
Empero cierto estoy yo de vosotros, hermanos míos, que aun vosotros mismos estáis llenos de bondad, llenos de todo conocimiento, de tal manera que podáis amonestaros los unos á los otros.
Mas os he escrito, hermanos, en parte resueltamente, como amonestándoos por la gracia que de Dios me es dada,
Para ser ministro de Jesucristo á los Gentiles, ministrando el evangelio de Dios, para que la ofrenda de los Gentiles sea agradable, santificada por el Espíritu Santo.
Tengo, pues, de qué gloriarme en Cristo Jesús en lo que mira á Dios.
Porque no osaría hablar alguna cosa que Cristo no haya hecho por mí para la obediencia de los Gentiles, con la palabra y con las obras,
Con potencia de milagros y prodigios, en virtud del Espíritu de Dios: de manera que desde Jerusalem, y por los alrededores hasta Ilírico, he llenado todo del evangelio de Cristo.
Y de esta manera me esforcé á predicar el evangelio, no donde antes Cristo fuese nombrado, por no edificar sobre ajeno fundamento:
Sino, como está escrito: A los que no fué anunciado de él, verán: y los que no oyeron, entenderán.
Por lo cual aun he sido impedido muchas veces de venir á vosotros.
Mas ahora no teniendo más lugar en estas regiones, y deseando ir á vosotros muchos años há,
Cuando partiere para España, iré á vosotros; porque espero que pasando os veré, y que seré llevado de vosotros allá, si empero antes hubiere gozado de vosotros.
Mas ahora parto para Jerusalem á ministrar á los santos.
Porque Macedonia y Acaya tuvieron por bien hacer una colecta para los pobres de los santos que están en Jerusalem.
Porque les pareció bueno, y son deudores á ellos: porque si los Gentiles han sido hechos participantes de sus bienes espirituales, deben también ellos servirles en los carnales.
Así que, cuando hubiere concluído esto, y les hubiere consignado este fruto, pasaré por vosotros á España.
Y sé que cuando llegue á vosotros, llegaré con abundancia de la bendición del evangelio de Cristo.
Ruégoos empero, hermanos, por el Señor nuestro Jesucristo, y por la caridad del Espíritu, que me ayudéis con oraciones por mí á Dios,
Que sea librado de los rebeldes que están en Judea, y que la ofrenda de mi servicio á los santos en Jerusalem sea acepta;
Para que con gozo llegue á vosotros por la voluntad de Dios, y que sea recreado juntamente con vosotros.
Y el Dios de paz sea con todos vosotros. Amén.
ENCOMIÉNDOOS empero á Febe nuestra hermana, la cual es diaconisa de la iglesia que está en Cencreas:
Que la recibáis en el Señor, como es digno á los santos, y que la ayudéis en cualquiera cosa en que os hubiere menester: porque ella ha ayudado á muchos, y á mí mismo.
Saludad á Priscila y á Aquila, mis coadjutores en Cristo Jesús;
(Que pusieron sus cuellos por mi vida: á los cuales no doy gracias yo solo, mas aun todas las iglesias de los Gentiles;)
Asimismo á la iglesia de su casa. Saludad á Epeneto, amado mío, que es las primicias de Acaya en Cristo.
Saludad á María, la cual ha trabajado mucho con vosotros.
Saludad á Andrónico y á Junia, mis parientes, y mis compañeros en la cautividad, los que son insignes entre los apóstoles; los cuales también fueron antes de mí en Cristo.
Saludad á Amplias, amado mío en el Señor.
Saludad á Urbano, nuestro ayudador en Cristo Jesús, y á Stachîs, amado mío.
Saludad á Apeles, probado en Cristo. Saludad á los que son de Aristóbulo.
Saludad á Herodión, mi pariente. Saludad á los que son dela casa deNarciso, los que están en el Señor.
Saludad á Trifena y á Trifosa, las cuales trabajan en el Señor. Saludad á Pérsida amada, la cual ha trabajado mucho en el Señor.
Saludad á Rufo, escogido en el Señor, y á su madre y mía.
Saludad á Asíncrito, y á Flegonte, á Hermas, á Patrobas, á Hermes, y á los hermanos que están con ellos.
Saludad á Filólogo y á Julia, á Nereo y á su hermana, y á Olimpas, y á todos los santos que están con ellos.
Saludaos los unos á los otros con ósculo santo. Os saludan todas las iglesias de Cristo.
Y os ruego hermanos, que miréis los que causan disensiones y escándalos contra la doctrina que vosotros habéis aprendido; y apartaos de ellos.
Porque los tales no sirven al Señor nuestro Jesucristo, sino á sus vientres; y con suaves palabras y bendiciones engañan los corazones de los simples.
Porque vuestra obediencia ha venido á ser notoria á todos; así que me gozo de vosotros; mas quiero que seáis sabios en el bien, y simples en el mal.
Y el Dios de paz quebrantará presto á Satanás debajo de vuestros pies. La gracia del Señor nuestro Jesucristoseacon vosotros.
Os saludan Timoteo, mi coadjutor, y Lucio y Jasón y Sosipater, mis parientes.
Yo Tercio, que escribí la epístola, os saludo en el Señor.
Salúdaos Gayo, mi huésped, y de toda la iglesia. Salúdaos Erasto, tesorero de la ciudad, y el hermano Cuarto.
La gracia del Señor nuestro Jesucristo sea con todos vosotros. Amén.
PABLO, llamadoá serapóstol de Jesucristo por la voluntad de Dios, y Sóstenes el hermano,
A la iglesia de Dios que está en Corinto, santificados en Cristo Jesús, llamados santos, y á todos los que invocan el nombre de nuestro Señor Jesucristo en cualquier lugar, Señorde ellos y nuestro:
Gracia y paz de Dios nuestro Padre, y del Señor Jesucristo.
Gracias doy á mi Dios siempre por vosotros, por la gracia de Dios que os es dada en Cristo Jesús;
Que en todas las cosas sois enriquecidos en él, en toda lengua y en toda ciencia;
Así como el testimonio de Cristo ha sido confirmado en vosotros:
De tal manera que nada os falte en ningún don, esperando la manifestación de nuestro Señor Jesucristo:
El cual también os confirmará hasta el fin, para que seáissin falta en el día de nuestro Señor Jesucristo.
Fiel es Dios, por el cual sois llamados á la participación de su Hijo Jesucristo nuestro Señor.
Porque me ha sido declarado de vosotros, hermanos míos, por los que son de Cloé, que hay entre vosotros contiendas;
Quiero decir, que cada uno de vosotros dice: Yo cierto soy de Pablo; pues yo de Apolos; y yo de Cefas; y yo de Cristo.
¿Está dividido Cristo? ¿Fué crucificado Pablo por vosotros? ¿ó habéis sido bautizados en el nombre de Pablo?
Doy gracias á Dios, que á ninguno de vosotros he bautizado, sino á Crispo y á Gayo;
Para que ninguno diga que habéis sido bautizados en mi nombre.
Y también bauticé la familia de Estéfanas: mas no sé si he bautizado algún otro.
Porque no me envió Cristo á bautizar, sino á predicar el evangelio: no en sabiduría de palabras, porque no sea hecha vana la cruz de Cristo.
Porque la palabra de la cruz es locura á los que se pierden; mas á los que se salvan, es á saber, á nosotros, es potencia de Dios.
Porque está escrito: Destruiré la sabiduría de los sabios, y desecharé la inteligencia de los entendidos.
¿Qué es del sabio? ¿qué del escriba? ¿qué del escudriñador de este siglo? ¿no ha enloquecido Dios la sabiduría del mundo?
Porque por no haber el mundo conocido en la sabiduría de Dios á Dios por sabiduría, agradó á Dios salvar á los creyentes por la locura de la predicación.
Porque los Judíos piden señales, y los Griegos buscan sabiduría:
Mas nosotros predicamos á Cristo crucificado, á los Judíos ciertamente tropezadero, y á los Gentiles locura;
Empero á los llamados, así Judíos como Griegos, Cristo potencia de Dios, y sabiduría de Dios.
Porque lo loco de Dios es más sabio que los hombres; y lo flaco de Dios es más fuerte que los hombres.
Porque mirad, hermanos, vuestra vocación, que no sois muchos sabios según la carne, no muchos poderosos, no muchos nobles;
Antes lo necio del mundo escogió Dios, para avergonzar á los sabios; y lo flaco del mundo escogió Dios, para avergonzar lo fuerte;
Y lo vil del mundo y lo menospreciado escogió Dios, y lo que no es, para deshacer lo que es:
Para que ninguna carne se jacte en su presencia.
Mas de él sois vosotros en Cristo Jesús, el cual nos ha sido hecho por Dios sabiduría, y justificación, y santificación, y redención:
Para que, como está escrito: El que se gloría, gloríese en el Señor.
ASÍ que, hermanos, cuando fuí á vosotros, no fuí con altivez de palabra, ó de sabiduría, á anunciaros el testimonio de Cristo.
Porque no me propuse saber algo entre vosotros, sino á Jesucristo, y á éste crucificado.
Y estuve yo con vosotros con flaqueza, y mucho temor y temblor;
Y ni mi palabra ni mi predicación fué con palabras persuasivas de humana sabiduría, mas con demostración del Espíritu y de poder;
Para que vuestra fe no esté fundada en sabiduría de hombres, mas en poder de Dios.
Empero hablamos sabiduría entre perfectos; y sabiduría, no de este siglo, ni de los príncipes de este siglo, que se deshacen:
Mas hablamos sabiduría de Dios en misterio, la sabiduría oculta, la cual Dios predestinó antes de los siglos para nuestra gloria:
La que ninguno de los príncipes de este siglo conoció; porque si la hubieran conocido, nunca hubieran crucificado al Señor de gloria:
Antes, como está escrito: Cosas que ojo no vió, ni oreja oyó, ni han subido en corazón de hombre, son las que ha Dios preparado para aquellos que le aman.
Empero Dios nos lo reveló á nosotros por el Espíritu: porque el Espíritu todo lo escudriña, aun lo profundo de Dios.
Porque ¿quién de los hombres sabe las cosas del hombre, sino el espíritu del hombre que está en él? Así tampoco nadie conoció las cosas de Dios, sino el Espíritu de Dios.
Y nosotros hemos recibido, no el espíritu del mundo, sino el Espíritu que es de Dios, para que conozcamos lo que Dios nos ha dado;
Lo cual también hablamos, no con doctas palabras de humana sabiduría, mas con doctrina del Espíritu, acomodando lo espiritual á lo espiritual.
Mas el hombre animal no percibe las cosas que son del Espíritu de Dios, porque le son locura: y no las puede entender, porque se han de examinar espiritualmente.
Empero el espiritual juzga todas las cosas; mas él no es juzgado de nadie.
Porque ¿quién conoció la mente del Señor? ¿quién le instruyó? Mas nosotros tenemos la mente de Cristo.
DE manera que yo, hermanos, no pude hablaros como á espirituales, sino como á carnales, como á niños en Cristo.
Os dí á beber leche, y no vianda: porque aun no podíais, ni aun podéis ahora;
Porque todavía sois carnales: pues habiendo entre vosotros celos, y contiendas, y disensiones, ¿no sois carnales, y andáis como hombres?
Porque diciendo el uno: Yo cierto soy de Pablo; y el otro: Yo de Apolos; ¿no sois carnales?
¿Qué pues es Pablo? ¿y qué es Apolos? Ministros por los cuales habéis creído; y eso según que á cada uno ha concedido el Señor.
Yo planté, Apolos regó: mas Dios ha dado el crecimiento.
Así que, ni el que planta es algo, ni el que riega; sino Dios, que da el crecimiento.
Y el que planta y el que riega son una misma cosa; aunque cada uno recibirá su recompensa conforme á su labor.
Porque nosotros, coadjutores somos de Dios; y vosotros labranza de Dios sois, edificio de Dios sois.
Conforme á la gracia de Dios que me ha sido dada, yo como perito arquitecto puse el fundamento, y otro edifica encima: empero cada uno vea cómo sobreedifica.
Porque nadie puede poner otro fundamento que el que está puesto, el cual es Jesucristo.
Y si alguno edificare sobre este fundamento oro, plata, piedras preciosas, madera, heno, hojarasca;
La obra de cada uno será manifestada: porque el día la declarará; porque por el fuego será manifestada; y la obra de cada uno cuál sea, el fuego hará la prueba.
Si permaneciere la obra de alguno que sobreedificó, recibirá recompensa.
Si la obra de alguno fuere quemada, será perdida: él empero será salvo, mas así como por fuego.
¿No sabéis que sois templo de Dios, y que el Espíritu de Dios mora en vosotros?
Si alguno violare el templo de Dios, Dios destruirá al tal: porque el templo de Dios, el cual sois vosotros, santo es.
Nadie se engañe á sí mismo: si alguno entre vosotros parece ser sabio en este siglo, hágase simple, para ser sabio.
Porque la sabiduría de este mundo es necedad para con Dios; pues escrito está: El que prende á los sabios en la astucia de ellos.
Y otra vez: El Señor conoce los pensamientos de los sabios, que son vanos.
Así que, ninguno se gloríe en los hombres; porque todo es vuestro;
Sea Pablo, sea Apolos, sea Cefas, sea el mundo, sea la vida, sea la muerte, sea lo presente, sea los por venir; todo es vuestro;
Y vosotros de Cristo; y Cristo de Dios.
TÉNGANNOS los hombres por ministros de Cristo, y dispensadores de los misterios de Dios.
Mas ahora se requiere en los dispensadores, que cada uno sea hallado fiel.
Yo en muy poco tengo el ser juzgado de vosotros, ó de juicio humano; y ni aun yo me juzgo.
Porque aunque de nada tengo mala conciencia, no por eso soy justificado; mas el que me juzga, el Señor es.
Porque ¿quién te distingue? ¿ó qué tienes que no hayas recibido? Y si lo recibiste, ¿de qué te glorías como si no hubieras recibido?
Ya estáis hartos, ya estáis ricos, sin nosotros reináis; y ojalá reinéis, para que nosotros reinemos también juntamente con vosotros.
Porque á lo que pienso, Dios nos ha mostrado á nosotros los apóstoles por los postreros, como á sentenciados á muerte: porque somos hechos espectáculo al mundo, y á los ángeles, y á los hombres.
Nosotros necios por amor de Cristo, y vosotros prudentes en Cristo; nosotros flacos, y vosotros fuertes; vosotros nobles, y nosotros viles.
Hasta esta hora hambreamos, y tenemos sed, y estamos desnudos, y somos heridos de golpes, y andamos vagabundos;
Y trabajamos, obrando con nuestras manos: nos maldicen, y bendecimos: padecemos persecución, y sufrimos:
Somos blasfemados, y rogamos: hemos venido á ser como la hez del mundo, el desecho de todos hasta ahora.
No escribo esto para avergonzaros: mas amonéstoos como á mis hijos amados.
Porque aunque tengáis diez mil ayos en Cristo, no tendréis muchos padres; que en Cristo Jesús yo os engendré por el evangelio.
Por tanto, os ruego que me imitéis.
Por lo cual os he enviado á Timoteo, que es mi hijo amado y fiel en el Señor, el cual os amonestará de mis caminos cuáles sean en Cristo, de la manera que enseño en todas partes en todas las iglesias.
Mas algunos están envanecidos, como si nunca hubiese yo de ir á vosotros.
Empero iré presto á vosotros, si el Señor quisiere; y entenderé, no las palabras de los que andan hinchados, sino la virtud.
Porque el reino de Dios no consiste en palabras, sino en virtud.
¿Qué queréis? ¿iré á vosotros con vara, ó con caridad y espíritu de mansedumbre?
DE cierto se oye que hay entre vosotros fornicación, y tal fornicación cual ni aun se nombra entre los Gentiles; tanto que alguno tenga la mujer de su padre.
Y vosotros estáis hinchados, y no más bien tuvisteis duelo, para que fuese quitado de en medio de vosotros el que hizo tal obra.
Y ciertamente, como ausente con el cuerpo, mas presente en espíritu, ya como presente he juzgado al que esto así ha cometido:
En el nombre del Señor nuestro Jesucristo, juntados vosotros y mi espíritu, con la facultad de nuestro Señor Jesucristo,
El tal sea entregado á Satanás para muerte de la carne, porque el espíritu sea salvo en el día del Señor Jesús.
No es buena vuestra jactancia. ¿No sabéis que un poco de levadura leuda toda la masa?
Limpiad pues la vieja levadura, para que seáis nueva masa, como sois sin levadura: porque nuestra pascua, que es Cristo, fué sacrificada por nosotros.
Así que hagamos fiesta, no en la vieja levadura, ni en la levadura de malicia y de maldad, sino en ázimos de sinceridad y de verdad.
Os he escrito por carta, que no os envolváis con los fornicarios:
No absolutamente con los fornicarios de este mundo, ó con los avaros, ó con los ladrones, ó con los idólatras; pues en tal caso os sería menester salir del mundo.
Porque ¿qué me va á mí en juzgar á los que están fuera? ¿No juzgáis vosotros á los que están dentro?
Porque á los que están fuera, Dios juzgará: quitad pues á ese malo de entre vosotros.
¿OSA alguno de vosotros, teniendo algo con otro, ir á juicio delante de los injustos, y no delante de los santos?
¿O no sabéis que los santos han de juzgar al mundo? Y si el mundo ha de ser juzgado por vosotros, ¿sois indignos de juzgar cosas muy pequeñas?
¿O no sabéis que hemos de juzgar á los ángeles? ¿cuánto más las cosas de este siglo?
Por tanto, si hubiereis de tener juicios de cosas de este siglo, poned para juzgar á los que son de menor estima en la iglesia.
Para avergonzaros lo digo. ¿Pues qué, no hay entre vosotros sabio, ni aun uno que pueda juzgar entre sus hermanos;
Sino que el hermano con el hermano pleitea en juicio, y esto ante los infieles?
Así que, por cierto es ya una falta en vosotros que tengáis pleitos entre vosotros mismos. ¿Por qué no sufrís antes la injuria? ¿por qué no sufrís antes ser defraudados?
Empero vosotros hacéis la injuria, y defraudáis, y esto á los hermanos.
¿No sabéis que los injustos no poseerán el reino de Dios? No erréis, que ni los fornicarios, ni los idólatras, ni los adúlteros, ni los afeminados, ni los que se echan con varones,
Ni los ladrones, ni los avaros, ni los borrachos, ni los maldicientes, ni los robadores, heredarán el reino de Dios.
Y esto erais algunos: mas ya sois lavados, mas ya sois santificados, mas ya sois justificados en el nombre del Señor Jesús, y por el Espíritu de nuestro Dios.
Todas las cosas me son lícitas, mas no todas convienen: todas las cosas me son lícitas, mas yo no me meteré debajo de potestad de nada.
Las viandas para el vientre, y el vientre para las viandas; empero y á él y á ellas deshará Dios. Mas el cuerpo no es para la fornicación, sino para el Señor; y el Señor para el cuerpo:
Y Dios que levantó al Señor, también á nosotros nos levantará con su poder.
¿No sabéis que vuestros cuerpos son miembros de Cristo? ¿Quitaré pues los miembros de Cristo, y los haré miembros de una ramera? Lejos sea.
¿O no sabéis que el que se junta con una ramera, es hecho con ella un cuerpo? porque serán, dice, los dos en una carne.
Empero el que se junta con el Señor, un espíritu es.
Huid la fornicación. Cualquier otro pecado que el hombre hiciere, fuera del cuerpo es; mas el que fornica, contra su propio cuerpo peca.
¿O ignoráis que vuestro cuerpo es templo del Espíritu Santo, el cual está en vosotros, el cual tenéis de Dios, y que no sois vuestros?
Porque comprados sois por precio: glorificad pues á Dios en vuestro cuerpo y en vuestro espíritu, los cuales son de Dios.
CUANTO á las cosas de que me escribisteis, bien es al hombre no tocar mujer.
Mas á causa de las fornicaciones, cada uno tenga su mujer, y cada una tenga su marido.
El marido pague á la mujer la debida benevolencia; y asimismo la mujer al marido.
La mujer no tiene potestad de su propio cuerpo, sino el marido: é igualmente tampoco el marido tiene potestad de su propio cuerpo, sino la mujer.
Mas esto digo por permisión, no por mandamiento.
Quisiera más bien que todos los hombres fuesen como yo: empero cada uno tiene su propio don de Dios; uno á la verdad así, y otro así.
Digo pues á los solteros y á las viudas, que bueno les es si se quedaren como yo.
Y si no tienen don de continencia, cásense; que mejor es casarse que quemarse.
Mas á los que están juntos en matrimonio, denuncio, no yo, sino el Señor: Que la mujer no se aparte del marido;
Y si se apartare, que se quede sin casar, ó reconcíliese con su marido; y que el marido no despida á su mujer.
Y á los demás yo digo, no el Señor: Si algún hermano tiene mujer infiel, y ella consiente en habitar con él, no la despida.
Y la mujer que tiene marido infiel, y él consiente en habitar con ella, no lo deje.
Porque el marido infiel es santificado en la mujer, y la mujer infiel en el marido: pues de otra manera vuestros hijos serían inmundos; empero ahora son santos.
Pero si el infiel se aparta, apártese: que no es el hermano ó la hermana sujeto á servidumbre en semejantecaso; antes á paz nos llamó Dios.
Porque ¿de dónde sabes, oh mujer, si quizá harás salvo á tu marido? ¿ó de dónde sabes, oh marido, si quizá harás salva á tu mujer?
Empero cada uno como el Señor le repartió, y como Dios llamó á cada uno, así ande: y así enseño en todas las iglesias.
¿Es llamado alguno circuncidado? quédese circunciso. ¿Es llamado alguno incircuncidado? que no se circuncide.
La circuncisión nada es, y la incircuncisión nada es; sino la observancia de las mandamientos de Dios.
Cada uno en la vocación en que fué llamado, en ella se quede.
¿Eres llamado siendo siervo? no se te dé cuidado: mas también si puedes hacerte libre, procúralo más.
Porque el que en el Señor es llamado siendo siervo, liberto es del Señor: asimismo también el que es llamado siendo libre, siervo es de Cristo.
Por precio sois comprados; no os hagáis siervos de los hombres.
Cada uno, hermanos, en lo que es llamado, en esto se quede para con Dios.
Empero de las vírgenes no tengo mandamiento del Señor; mas doy mi parecer, como quien ha alcanzado misericordia del Señor para ser fiel.
Tengo, pues, esto por bueno á causa de la necesidad que apremia, que bueno es al hombre estarse así.
¿Estás ligado á mujer? no procures soltarte. ¿Estás suelto de mujer? no procures mujer.
Mas también si tomares mujer, no pecaste; y si la doncella se casare, no pecó: pero aflicción de carne tendrán los tales: mas yo os dejo.
Esto empero digo, hermanos, que el tiempo es corto: lo que resta es, que los que tienen mujeres sean como los que no las tienen;
Y los que lloran, como los que no lloran; y los que se huelgan, como los que no se huelgan; y los que compran, como los que no poseen;
Y los que usan de este mundo, como los que no usan: porque la apariencia de este mundo se pasa.
Quisiera, pues, que estuvieseis sin congoja. El soltero tiene cuidado de las cosas que son del Señor, cómo ha de agradar al Señor:
Empero el que se casó tiene cuidado de las cosas que son del mundo, cómo ha de agradar á su mujer.
Esto empero digo para vuestro provecho; no para echaros lazo, sino para lo honesto y decente, y para que sin impedimento os lleguéis al Señor.
Mas, si á alguno parece cosa fea en su hija virgen, que pase ya de edad, y que así conviene que se haga, haga lo que quisiere, no peca; cásese.
Pero el que está firme en su corazón, y no tiene necesidad, sino que tiene libertad de su voluntad, y determinó en su corazón esto, el guardar su hija virgen, bien hace.
Así que, el que la da en casamiento, bien hace; y el que no la da en casamiento, hace mejor.
La mujer casada está atada á la ley, mientras vive su marido; mas si su marido muriere, libre es: cásese con quien quisiere, con tal que sea en el Señor.
Empero más venturosa será si se quedare así, según mi consejo; y pienso que también yo tengo Espíritu de Dios.
Y POR lo que hace á lo sacrificado á los ídolos, sabemos que todos tenemos ciencia. La ciencia hincha, mas la caridad edifica.
Y si alguno se imagina que sabe algo, aun no sabe nada como debe saber.
Mas si alguno ama á Dios, el tal es conocido de él.
Acerca, pues, de las viandas que son sacrificadas á los ídolos, sabemos que el ídolo nada es en el mundo, y que no hay más de un Dios.
Porque aunque haya algunos que se llamen dioses, ó en el cielo, ó en la tierra (como hay muchos dioses y muchos señores),
Nosotros empero no tenemos más de un Dios, el Padre, del cual son todas las cosas, y nosotros en él: y un Señor Jesucristo, por el cual son todas las cosas, y nosotros por él.
Mas no en todos hay esta ciencia: porque algunos con conciencia del ídolo hasta aquí, comen como sacrificado á ídolos; y su conciencia, siendo flaca, es contaminada.
Si bien la vianda no nos hace más aceptos á Dios: porque ni que comamos, seremos más ricos; ni que no comamos, seremos más pobres.
Mas mirad que esta vuestra libertad no sea tropezadero á los que son flacos.
Porque si te ve alguno, á ti que tienes ciencia, que estás sentado á la mesa en el lugar de los ídolos, ¿la conciencia de aquel que es flaco, no será adelantada á comer de lo sacrificado á los ídolos?
Y por tu ciencia se perderá el hermano flaco por el cual Cristo murió.
De esta manera, pues, pecando contra los hermanos, é hiriendo su flaca conciencia, contra Cristo pecáis.
Por lo cual, si la comida es á mi hermano ocasión de caer, jamás comeré carne por no escandalizar á mi hermano.
¿NO soy apóstol? ¿no soy libre? ¿no he visto á Jesús el Señor nuestro? ¿no sois vosotros mi obra en el Señor?
Si á los otros no soy apóstol, á vosotros ciertamente lo soy: porque el sello de mi apostolado sois vosotros en el Señor.
Esta es mi respuesta á los que me preguntan.
Qué, ¿no tenemos potestad de comer y de beber?
¿No tenemos potestad de traer con nosotros una hermana mujer también como los otros apóstoles, y los hermanos del Señor, y Cefas?
¿O sólo yo y Bernabé no tenemos potestad de no trabajar?
¿Quién jamás peleó á sus expensas? ¿quién planta viña, y no come de su fruto? ¿ó quién apacienta el ganado, y no come de la leche del ganado?
¿Digo esto según los hombres? ¿no dice esto también la ley?
Porque en la ley de Moisés está escrito: No pondrás bozal al buey que trilla. ¿Tiene Dios cuidado de los bueyes?
¿O dícelo enteramente por nosotros? Pues por nosotros está escrito; porque con esperanza ha de arar el que ara; y el que trilla, con esperanza de recibir el fruto.
Si nosotros os sembramos lo espiritual, ¿es gran cosa si segáremos lo vuestro carnal?
Si otros tienen en vosotros esta potestad, ¿no más bien nosotros? Mas no hemos usado de esta potestad: antes lo sufrimos todo, por no poner ningún obstáculo al evangelio de Cristo.
¿No sabéis que los que trabajan en el santuario, comen del santuario; y que los que sirven al altar, del altar participan?
Así también ordenó el Señor á los que anuncian el evangelio, que vivan del evangelio.
Mas yo de nada de esto me aproveché: ni tampoco he escrito esto para que se haga así conmigo; porque tengo por mejor morir, antes que nadie haga vana esta mi gloria.
Pues bien que anuncio el evangelio, no tengo por qué gloriarme; porque me es impuesta necesidad; y ¡ay de mí si no anunciare el evangelio!
Por lo cual, si lo hago de voluntad, premio tendré; mas si por fuerza, la dispensación me ha sido encargada.
¿Cuál, pues, es mi merced? Que predicando el evangelio, ponga el evangelio de Cristo de balde, para no usar mal de mi potestad en el evangelio.
Por lo cual, siendo libre para con todos, me he hecho siervo de todos por ganar á más.
Heme hecho á los Judíos como Judío, por ganar á los Judíos; á los que están sujetos á la ley (aunque yo no sea sujeto á la ley) como sujeto á la ley, por ganar á los que están sujetos á la ley;
A los que son sin ley, como si yo fuera sin ley, (no estando yo sin ley de Dios, mas en la ley de Cristo) por ganar á los que estaban sin ley.
Me he hecho á los flacos flaco, por ganar á los flacos: á todos me he hecho todo, para que de todo punto salve á algunos.
Y esto hago por causa del evangelio, por hacerme juntamente participante de él.
¿No sabéis que los que corren en el estadio, todos á la verdad corren, mas uno lleva el premio? Corred de tal manera que lo obtengáis.
Y todo aquel que lucha, de todo se abstiene: y ellos, á la verdad, para recibir una corona corruptible; mas nosotros, incorruptible.
Así que, yo de esta manera corro, no como á cosa incierta; de esta manera peleo, no como quien hiere el aire:
Antes hiero mi cuerpo, y lo pongo en servidumbre; no sea que, habiendo predicado á otros, yo mismo venga á ser reprobado.
PORQUE no quiero, hermanos, que ignoréis que nuestros padres todos estuvieron bajo la nube, y todos pasaron la mar;
Y todos en Moisés fueron bautizados en la nube y en la mar;
Y todos comieron la misma vianda espiritual;
Y todos bebieron la misma bebida espiritual; porque bebían de la piedra espiritual que los seguía, y la piedra era Cristo:
Mas de muchos de ellos no se agradó Dios; por lo cual fueron postrados en el desierto.
Empero estas cosas fueron en figura de nosotros, para que no codiciemos cosas malas, como ellos codiciaron.
Ni seáis honradores de ídolos, como algunos de ellos; según está escrito: Sentóse el pueblo á comer y á beber, y se levantaron á jugar.
Ni forniquemos, como algunos de ellos fornicaron, y cayeron en un día veinte y tres mil.
Ni tentemos á Cristo, como también algunos de ellosletentaron, y perecieron por las serpientes.
Ni murmuréis, como algunos de ellos murmuraron, y perecieron por el destructor.
Y estas cosas les acontecieron en figura; y son escritas para nuestra admonición, en quienes los fines de los siglos han parado.
Así que, el que piensa estar firme, mire no caiga.
Por tanto, amados míos, huid de la idolatría.
Como á sabios hablo; juzgad vosotros lo que digo.
La copa de bendición que bendecimos, ¿no es la comunión de la sangre de Cristo? El pan que partimos, ¿no es la comunión del cuerpo de Cristo?
Porque un pan, es que muchos somos un cuerpo; pues todos participamos de aquel un pan.
Mirad á Israel según la carne: los que comen de los sacrificios ¿no son partícipes con el altar?
¿Qué pues digo? ¿Que el ídolo es algo? ¿ó que sea algo lo que es sacrificado á los ídolos?
Antes digo que lo que los Gentiles sacrifican, á los demonios lo sacrifican, y no á Dios: y no querría que vosotros fueseis partícipes con los demonios.
No podéis beber la copa del Señor, y la copa de los demonios: no podéis ser partícipes de la mesa del Señor, y de la mesa de los demonios.
¿O provocaremos á celo al Señor? ¿Somos más fuertes que él?
Todo me es lícito, mas no todo conviene: todo me es lícito, mas no todo edifica.
Ninguno busque su propio bien, sino el del otro.
De todo lo que se vende en la carnicería, comed, sin preguntar nada por causa de la conciencia;
Porque del Señor es la tierra y lo que la hinche.
Y si algún infiel os llama, y queréis ir, de todo lo que se os pone delante comed, sin preguntar nada por causa de la conciencia.
Mas si alguien os dijere: Esto fué sacrificado á los ídolos: no lo comáis, por causa de aquel que lo declaró, y por causa de la conciencia: porque del Señor es la tierra y lo que la hinche.
La conciencia, digo, no tuya, sino del otro. Pues ¿por qué ha de ser juzgada mi libertad por otra conciencia?
Y si yo con agradecimiento participo, ¿por qué he de ser blasfemado por lo que doy gracias?
Si pues coméis, ó bebéis, ó hacéis otra cosa, hacedlo todo á gloria de Dios.
Sed sin ofensa á Judíos, y á Gentiles, y á la iglesia de Dios:
Como también yo en todas las cosas complazco á todos, no procurando mi propio beneficio, sino el de muchos, para que sean salvos.
SED imitadores de mí, así como yo de Cristo.
Y os alabo, hermanos, que en todo os acordáis de mí, y retenéis las instruccionesmías, de la manera que os enseñé.
Mas quiero que sepáis, que Cristo es la cabeza de todo varón; y el varón es la cabeza de la mujer; y Dios la cabeza de Cristo.
Todo varón que ora ó profetiza cubierta la cabeza, afrenta su cabeza.
Mas toda mujer que ora ó profetiza no cubierta su cabeza, afrenta su cabeza; porque lo mismo es que si se rayese.
Porque si la mujer no se cubre, trasquílese también: y si es deshonesto á la mujer trasquilarse ó raerse, cúbrase.
Porque el varón no ha de cubrir la cabeza, porque es imagen y gloria de Dios: mas la mujer es gloria del varón.
Porque el varón no es de la mujer, sino la mujer del varón.
Porque tampoco el varón fué criado por causa de la mujer, sino la mujer por causa del varón.
Por lo cual, la mujer debe tener señal de potestad sobre su cabeza, por causa de los ángeles.
Mas ni el varón sin la mujer, ni la mujer sin el varón, en el Señor.
Porque como la mujer es del varón, así también el varón es por la mujer: empero todo de Dios.
Juzgad vosotros mismos: ¿es honesto orar la mujer á Dios no cubierta?
La misma naturaleza ¿no os enseña que al hombre sea deshonesto criar cabello?
Por el contrario, á la mujer criar el cabello le es honroso; porque en lugar de velo le es dado el cabello.
Con todo eso, si alguno parece ser contencioso, nosotros no tenemos tal costumbre, ni las iglesias de Dios.
Esto empero os denuncio, que no alabo, que no por mejor sino por peor os juntáis.
Porque lo primero, cuando os juntáis en la iglesia, oigo que hay entre vosotros disensiones; y en parte lo creo.
Porque preciso es que haya entre vosotros aun herejías, para que los que son probados se manifiesten entre vosotros.
Cuando pues os juntáis en uno, esto no es comer la cena del Señor:
Porque cada uno toma antes para comer su propia cena; y el uno tiene hambre, y el otro está embriagado.
Pues qué, ¿no tenéis casas en que comáis y bebáis? ¿ó menospreciáis la iglesia de Dios, y avergonzáis á los que no tienen? ¿Qué os diré? ¿os alabaré? En esto no os alabo.
Porque yo recibí del Señor lo que también os he enseñado: Que el Señor Jesús, la noche que fué entregado, tomó pan;
Y habiendo dado gracias, lo partió, y dijo: Tomad, comed: esto es mi cuerpo que por vosotros es partido: haced esto en memoria de mí.
Asimismo tomó también la copa, después de haber cenado, diciendo: Esta copa es el nuevo pacto en mi sangre: haced esto todas las veces que bebiereis, en memoria de mí.
Porque todas las veces que comiereis este pan, y bebiereis esta copa, la muerte del Señor anunciáis hasta que venga.
De manera que, cualquiera que comiere este pan ó bebiere esta copa del Señor indignamente, será culpado del cuerpo y de la sangre del Señor.
Por tanto, pruébese cada uno á sí mismo, y coma así de aquel pan, y beba de aquella copa.
Porque el que come y bebe indignamente, juicio come y bebe para sí, no discerniendo el cuerpo del Señor.
Por lo cual hay muchos enfermos y debilitados entre vosotros; y muchos duermen.
Que si nos examinásemos á nosotros mismos, cierto no seríamos juzgados.
Mas siendo juzgados, somos castigados del Señor, para que no seamos condenados con el mundo.
Así, que, hermanos míos, cuando os juntáis á comer, esperaos unos á otros.
Si alguno tuviere hambre, coma en su casa, porque no os juntéis para juicio. Las demás cosas ordenaré cuando llegare.
Y ACERCA de losdonesespirituales, no quiero, hermanos, que ignoréis.
Sabéis que cuando erais Gentiles, ibais, como erais llevados, á los ídolos mudos.
Por tanto os hago saber, que nadie que hable por Espíritu de Dios, llama anatema á Jesús; y nadie puede llamar á Jesús Señor, sino por Espíritu Santo.
Empero hay repartimiento de dones; mas el mismo Espíritues.
Y hay repartimiento de ministerios; mas el mismo Señores.
Y hay repartimiento de operaciones; mas el mismo Dios es el que obra todas las cosas en todos.
Empero á cada uno le es dada manifestación del Espíritu para provecho.
Porque á la verdad, á éste es dada por el Espíritu palabra de sabiduría; á otro, palabra de ciencia según el mismo Espíritu;
A otro, fe por el mismo Espíritu; y á otro, dones de sanidades por el mismo Espíritu;
A otro, operaciones de milagros; y á otro, profecía; y á otro, discreción de espíritus; y á otro, géneros de lenguas; y á otro, interpretación de lenguas.
Mas todas estas cosas obra uno y el mismo Espíritu, repartiendo particularmente á cada uno como quiere.
Porque de la manera que el cuerpo es uno, y tiene muchos miembros, empero todos los miembros del cuerpo, siendo muchos, son un cuerpo, así también Cristo.
Porque por un Espíritu somos todos bautizados en un cuerpo, ora Judíos ó Griegos, ora siervos ó libres; y todos hemos bebido de un mismo Espíritu.
Pues ni tampoco el cuerpo es un miembro, sino muchos.
Si dijere el pie: Porque no soy mano, no soy del cuerpo: ¿por eso no será del cuerpo?
Y si dijere la oreja: Porque no soy ojo, no soy del cuerpo: ¿por eso no será del cuerpo?
Si todo el cuerpo fuese ojo, ¿dónde estaría el oído? Si todo fuese oído, ¿dónde estaría el olfato?
Mas ahora Dios ha colocado los miembros cada uno de ellos en el cuerpo, como quiso.
Que si todos fueran un miembro, ¿dónde estuviera el cuerpo?
Mas ahora muchos miembros son á la verdad, empero un cuerpo.
Ni el ojo puede decir á la mano: No te he menester: ni asimismo la cabeza á los pies: No tengo necesidad de vosotros.
Antes, mucho más los miembros del cuerpo que parecen más flacos, son necesarios;
Y á aquellos del cuerpo que estimamos ser más viles, á éstos vestimos más honrosamente; y los que en nosotros son menos honestos, tienen más compostura.
Porque los que en nosotros son más honestos, no tienen necesidad: mas Dios ordenó el cuerpo, dando más abundante honor al que le faltaba;
Para que no haya desavenencia en el cuerpo, sino que los miembros todos se interesen los unos por los otros.
Por manera que si un miembro padece, todos los miembros á una se duelen; y si un miembro es honrado, todos los miembros á una se gozan.
Pues vosotros sois el cuerpo de Cristo, y miembros en parte.
Y á unos puso Dios en la iglesia, primeramente apóstoles, luego profetas, lo tercero doctores; luego facultades; luego dones de sanidades, ayudas, gobernaciones, géneros de lenguas.
¿Son todos apóstoles? ¿son todos profetas? ¿todos doctores? ¿todos facultades?
¿Tienen todos dones de sanidad? ¿hablan todos lenguas? ¿interpretan todos?
Empero procurad los mejores dones: mas aun yo os muestro un camino más excelente.
SI yo hablase lenguas humanas y angélicas, y no tengo caridad, vengo á sercomometal que resuena, ó címbalo que retiñe.
Y si tuviese profecía, y entendiese todos los misterios y toda ciencia; y si tuviese toda la fe, de tal manera que traspasase los montes, y no tengo caridad, nada soy.
Y si repartiese toda mi hacienda para dar de comer á pobres, y si entregase mi cuerpo para ser quemado, y no tengo caridad, de nada me sirve.
La caridad es sufrida, es benigna; la caridad no tiene envidia, la caridad no hace sinrazón, no se ensancha;
No es injuriosa, no busca lo suyo, no se irrita, no piensa el mal;
No se huelga de la injusticia, mas se huelga de la verdad;
Todo lo sufre, todo lo cree, todo lo espera, todo lo soporta.
La caridad nunca deja de ser: mas las profecías se han de acabar, y cesarán las lenguas, y la ciencia ha de ser quitada;
Porque en parte conocemos, y en parte profetizamos;
Mas cuando venga lo que es perfecto, entonces lo que es en parte será quitado.
Cuando yo era niño, hablaba como niño, pensaba como niño, juzgaba como niño; mas cuando ya fuí hombre hecho, dejé lo que era de niño.
Ahora vemos por espejo, en obscuridad; mas entonces veremos cara á cara: ahora conozco en parte; mas entonces conoceré como soy conocido.
Y ahora permanecen la fe, la esperanza, y la caridad, estas tres: empero la mayor de ellas es la caridad.
SEGUID la caridad; y procurad losdonesespirituales, mas sobre todo que profeticéis.
Porque el que habla en lenguas, no habla á los hombres, sino á Dios; porque nadie le entiende, aunque en espíritu hable misterios.
Mas el que profetiza, habla á los hombresparaedificación, y exhortación, y consolación.
El que habla lengua extraña, á sí mismo se edifica; mas el que profetiza, edifica á la iglesia.
Ahora pues, hermanos, si yo fuere á vosotros hablando lenguas, ¿qué os aprovecharé, si no os hablare, ó con revelación, ó con ciencia, ó con profecía, ó con doctrina?
Ciertamente las cosas inanimadas que hacen sonidos, como la flauta ó la vihuela, si no dieren distinción de voces, ¿cómo se sabrá lo que se tañe con la flauta, ó con la vihuela?
Y si la trompeta diere sonido incierto, ¿quién se apercibirá á la batalla?
Así también vosotros, si por la lengua no diereis palabra bien significante, ¿cómo se entenderá lo que se dice? porque hablaréis al aire.
Tantos géneros de voces, por ejemplo, hay en el mundo, y nada hay mudo;
Mas si yo ignorare el valor de la voz, seré bárbaro al que habla, y el que habla será bárbaro para mí.
Así también vosotros; pues que anheláis espirituales dones, procurad ser excelentes para la edificación de la iglesia.
Por lo cual, el que habla lengua extraña, pida que la interprete.
Porque si yo orare en lengua desconocida, mi espíritu ora; mas mi entendimiento es sin fruto.
¿Qué pues? Oraré con el espíritu, mas oraré también con entendimiento; cantaré con el espíritu, mas cantaré también con entendimiento.
Porque si bendijeres con el espíritu, el que ocupa lugar de un mero particular, ¿cómo dirá amén á tu acción de gracias? pues no sabe lo que has dicho.
Porque tú, á la verdad, bien haces gracias; mas el otro no es edificado.
Doy gracias á Dios que hablo lenguas más que todos vosotros:
Pero en la iglesia más quiero hablar cinco palabras con mi sentido, para que enseñe también á los otros, que diez mil palabras en lengua desconocida.
Hermanos, no seáis niños en el sentido, sino sed niños en la malicia: empero perfectos en el sentido.
En la ley está escrito: En otras lenguas y en otros labios hablaré á este pueblo; y ni aun así me oirán, dice el Señor.
Así que, las lenguas por señal son, no á los fieles, sino á los infieles: mas la profecía, no á los infieles, sino á los fieles.
De manera que, si toda la iglesia se juntare en uno, y todos hablan lenguas, y entran indoctos ó infieles, ¿no dirán que estáis locos?
Mas si todos profetizan, y entra algún infiel ó indocto, de todos es convencido, de todos es juzgado;
Lo oculto de su corazón se hace manifiesto: y así, postrándose sobre el rostro, adorará á Dios, declarando que verdaderamente Dios está en vosotros.
Si hablare alguno en lengua extraña, sea esto por dos, ó á lo más tres, y por turno; mas uno interprete.
Y si no hubiere intérprete, calle en la iglesia, y hable á sí mismo y á Dios.
Asimismo, los profetas hablen dos ó tres, y los demás juzguen.
Y si á otro que estuviere sentado, fuere revelado, calle el primero.
Porque podéis todos profetizar uno por uno, para que todos aprendan, y todos sean exhortados.
Y los espíritus de los que profetizaren, sujétense á los profetas;
Porque Dios no es Dios de disensión, sino de paz; como en todas las iglesias de los santos.
Vuestras mujeres callen en las congregaciones; porque no les es permitido hablar, sino que estén sujetas, como también la ley dice.
Y si quieren aprender alguna cosa, pregunten en casa á sus maridos; porque deshonesta cosa es hablar una mujer en la congregación.
Qué, ¿ha salido de vosotros la palabra de Dios? ¿ó á vosotros solos ha llegado?
Si alguno á su parecer, es profeta, ó espiritual, reconozca lo que os escribo, porque son mandamientos del Señor.
Mas el que ignora, ignore.
Así que, hermanos, procurad profetizar; y no impidáis el hablar lenguas.
Empero hágase todo decentemente y con orden.
ADEMÁS os declaro, hermanos, el evangelio que os he predicado, el cual también recibisteis, en el cual también perseveráis;
Por el cual asimismo, si retenéis la palabra que os he predicado, sois salvos, si no creísteis en vano.
Porque primeramente os he enseñado lo que asimismo recibí: Que Cristo fué muerto por nuestros pecados, conforme á las Escrituras;
Y que fué sepultado, y que resucitó al tercer día, conforme á las Escrituras;
Y que apareció á Cefas, y después á los doce.
Después apareció á más de quinientos hermanos juntos; de los cuales muchos viven aún, y otros son muertos.
Después apareció á Jacobo; después á todos los apóstoles.
Y el postrero de todos, como á un abortivo, me apareció á mí.
Porque yo soy el más pequeño de los apóstoles, que no soy digno de ser llamado apóstol, porque perseguí la iglesia de Dios.
Empero por la gracia de Dios soy lo que soy: y su gracia no ha sido en vano para conmigo; antes he trabajado más que todos ellos: pero no yo, sino la gracia de Dios que fué conmigo.
Porque, ó sea yo ó sean ellos, así predicamos, y así habéis creído.
Y si Cristo es predicado que resucitó de los muertos, ¿cómo dicen algunos entre vosotros que no hay resurrección de muertos?
Porque si no hay resurrección de muertos, Cristo tampoco resucitó:
Y si Cristo no resucitó, vana es entonces nuestra predicación, vana es también vuestra fe.
Y aun somos hallados falsos testigos de Dios; porque hemos testificado de Dios que él haya levantado á Cristo; al cual no levantó, si en verdad los muertos no resucitan.
Porque si los muertos no resucitan, tampoco Cristo resucitó:
Y si Cristo no resucitó, vuestra fe es vana; aun estáis en vuestros pecados.
Entonces también los que durmieron en Cristo son perdidos.
Si en esta vida solamente esperamos en Cristo, los más miserables somos de todos los hombres.
Mas ahora Cristo ha resucitado de los muertos; primicias de los que durmieron es hecho.
Porque por cuanto la muerte entró por un hombre, también por un hombre la resurrección de los muertos.
Porque así como en Adam todos mueren, así también en Cristo todos serán vivificados.
Mas cada uno en su orden: Cristo las primicias; luego los que son de Cristo, en su venida.
Luego el fin; cuando entregará el reino á Dios y al Padre, cuando habrá quitado todo imperio, y toda potencia y potestad.
Porque es menester que él reine, hasta poner á todos sus enemigos debajo de sus pies.
Y el postrer enemigo que será deshecho, será la muerte.
Porque todas las cosas sujetó debajo de sus pies. Y cuando dice: Todas las cosas son sujetadas á él, claro está exceptuado aquel que sujetó á él todas las cosas.
Mas luego que todas las cosas le fueren sujetas, entonces también el mismo Hijo se sujetará al que le sujetó á él todas las cosas, para que Dios sea todas las cosas en todos.
De otro modo, ¿qué harán los que se bautizan por los muertos, si en ninguna manera los muertos resucitan? ¿Por qué pues se bautizan por los muertos?
¿Y por qué nosotros peligramos á toda hora?
Sí, por la gloria que en orden á vosotros tengo en Cristo Jesús Señor nuestro, cada día muero.
Si como hombre batallé en Efeso contra las bestias, ¿qué me aprovecha? Si los muertos no resucitan, comamos y bebamos, que mañana moriremos.
No erréis: las malas conversaciones corrompen las buenas costumbres.
Velad debidamente, y no pequéis; porque algunos no conocen á Dios: para vergüenza vuestra hablo.
Mas dirá alguno: ¿Cómo resucitarán los muertos? ¿Con qué cuerpo vendrán?
Necio, lo que tú siembras no se vivifica, si no muriere antes.
Y lo que siembras, no siembras el cuerpo que ha de salir, sino el grano desnudo, acaso de trigo, ó de otro grano:
Mas Dios le da el cuerpo como quiso, y á cada simiente su propio cuerpo.
Toda carne no es la misma carne; mas una carne ciertamente es la de los hombres, y otra carne la de los animales, y otra la de los peces, y otra la de las aves.
Y cuerpos hay celestiales, y cuerpos terrestres; mas ciertamente una es la gloria de los celestiales, y otra la de los terrestres.
Otra es la gloria del sol, y otra la gloria de la luna, y otra la gloria de las estrellas: porque una estrella es diferente de otra en gloria.
Así también es la resurrección de los muertos. Se siembra en corrupción, se levantará en incorrupción;
Se siembra en vergüenza, se levantará con gloria; se siembra en flaqueza, se levantará con potencia;
Se siembra cuerpo animal, resucitará espiritual cuerpo. Hay cuerpo animal, y hay cuerpo espiritual.
Así también está escrito: Fué hecho el primer hombre Adam en ánima viviente; el postrer Adam en espíritu vivificante.
Mas lo espiritual no es primero, sino lo animal; luego lo espiritual.
El primer hombre, es de la tierra, terreno: el segundo hombre, que es el Señor, es del cielo.
Cual el terreno, tales también los terrenos; y cual el celestial, tales también los celestiales.
Y como trajimos la imagen del terreno, traeremos también la imagen del celestial.
Esto empero digo, hermanos: que la carne y la sangre no pueden heredar el reino de Dios; ni la corrupción hereda la incorrupción.
He aquí, os digo un misterio: Todos ciertamente no dormiremos, mas todos seremos transformados,
En un momento, en un abrir de ojo, á la final trompeta; porque será tocada la trompeta, y los muertos serán levantados sin corrupción, y nosotros seremos transformados.
Porque es menester que esto corruptible sea vestido de incorrupción, y esto mortal sea vestido de inmortalidad.
Y cuando esto corruptible fuere vestido de incorrupción, y esto mortal fuere vestido de inmortalidad, entonces se efectuará la palabra que está escrita: Sorbida es la muerte con victoria.
¿Dónde está, oh muerte, tu aguijón? ¿dónde, oh sepulcro, tu victoria?
Ya que el aguijón de la muerte es el pecado, y la potencia del pecado, la ley.
Mas á Dios gracias, que nos da la victoria por el Señor nuestro Jesucristo.
Así que, hermanos míos amados, estad firmes y constantes, creciendo en la obra del Señor siempre, sabiendo que vuestro trabajo en el Señor no es vano.
CUANTO á la colecta para los santos, haced vosotros también de la manera que ordené en las iglesias de Galacia.
Cada primer día de la semana cada uno de vosotros aparte en su casa, guardando lo que por la bondad de Dios pudiere; para que cuando yo llegare, no se hagan entonces colectas.
Y cuando habré llegado, los que aprobareis por cartas, á éstos enviaré que lleven vuestro beneficio á Jerusalem.
Y si fuere digno el negocio de que yo también vaya, irán conmigo.
Y á vosotros iré, cuando hubiere pasado por Macedonia, porque por Macedonia tengo de pasar:
Y podrá ser que me quede con vosotros, ó invernaré también, para que vosotros me llevéis á donde hubiere de ir.
Porque no os quiero ahora ver de paso; porque espero estar con vosotros algún tiempo, si el Señor lo permitiere.
Empero estaré en Efeso hasta Pentecostés;
Porque se me ha abierto puerta grande y eficaz, y muchos son los adversarios.
Y si llegare Timoteo, mirad que esté con vosotros seguramente; porque la obra del Señor hace también como yo.
Por tanto, nadie le tenga en poco; antes, llevadlo en paz, para que venga á mí: porque lo espero con los hermanos.
Acerca del hermano Apolos, mucho le he rogado que fuese á vosotros con los hermanos; mas en ninguna manera tuvo voluntad de ir por ahora; pero irá cuando tuviere oportunidad.
Velad, estad firmes en la fe; portaos varonilmente, y esforzaos.
Todas vuestras cosas sean hechas con caridad.
Y os ruego, hermanos, (ya sabéis que la casa de Estéfanas es las primicias de Acaya, y que se han dedicado al ministerio de los santos,)
Que vosotros os sujetéis á los tales, y á todos los que ayudan y trabajan.
Huélgome de la venida de Estéfanas y de Fortunato y de Achâico: porque éstos suplieron lo que á vosotros faltaba.
Porque recrearon mi espíritu y el vuestro: reconoced pues á los tales.
Las iglesias de Asia os saludan. Os saludan mucho en el Señor Aquila y Priscila, con la iglesia que está en su casa.
Os saludan todos los hermanos. Saludaos los unos á los otros con ósculo santo.
La salutación de mí, Pablo, de mi mano.
El que no amare al Señor Jesucristo, sea anatema. Maranatha.
La gracia del Señor Jesucristo sea con vosotros.
PABLO, apóstol de Jesucristo por la voluntad de Dios, y Timoteo el hermano, á la iglesia de Dios que está en Corinto, juntamente con todos los santos que están por toda la Acaya:
Gracia y paz á vosotros de Dios nuestro Padre, y del Señor Jesucristo.
Benditoseael Dios y Padre del Señor Jesucristo, el Padre de misericordias, y el Dios de toda consolación,
El cual nos consuela en todas nuestras tribulaciones, para que podamos también nosotros consolar á los que están en cualquiera angustia, con la consolación con que nosotros somos consolados de Dios.
Porque de la manera que abundan en nosotros las aflicciones de Cristo, así abunda también por el mismo Cristo nuestra consolación.
Y nuestra esperanza de vosotros es firme; estando ciertos que como sois compañeros de las aflicciones, así también lo sois de la consolación.
Mas nosotros tuvimos en nosotros mismos respuesta de muerte, para que no confiemos en nosotros mismos, sino en Dios que levanta los muertos:
El cual nos libró, y libra de tanta muerte; en el cual esperamos que aun nos librará;
Ayudándonos también vosotros con oración por nosotros, para que por la merced hecha á nos por respeto de muchos, por muchos sean hechas gracias por nosotros.
Porque no os escribimos otras cosas de las que leéis, ó también conocéis: y espero que aun hasta el fin las conoceréis:
Como también en parte habéis conocido que somos vuestra gloria, así como también vosotros la nuestra, para el día del Señor Jesús.
Y con esta confianza quise primero ir á vosotros, para que tuvieseis una segunda gracia;
Y por vosotros pasar á Macedonia, y de Macedonia venir otra vez á vosotros, y ser vuelto de vosotros á Judea.
Así que, pretendiendo esto, ¿usé quizá de liviandad? ó lo que pienso hacer, ¿piénsolo según la carne, para que haya en mí Sí y No?
Antes, Dios fiel sabe que nuestra palabra para con vosotros no es Sí y No.
Porque el Hijo de Dios, Jesucristo, que por nosotros ha sido entre vosotros predicado, por mí y Silvano y Timoteo, no ha sido Sí y No; mas ha sido Sí en él.
Porque todas las promesas de Dios son en él Sí, y en él Amén, por nosotros á gloria de Dios.
Y el que nos confirma con vosotros en Cristo, y el que nos ungió, es Dios;
El cual también nos ha sellado, y dado la prenda del Espíritu en nuestros corazones.
Mas yo llamo á Dios por testigo sobre mi alma, que por ser indulgente con vosotros no he pasado todavía á Corinto.
No que nos enseñoreemos de vuestra fe, mas somos ayudadores de vuestro gozo: porque por la fe estáis firmes.
ESTO pues determiné para conmigo, no venir otra vez á vosotros con tristeza.
Porque si yo os contristo, ¿quién será luego el que me alegrará, sino aquel á quien yo contristare?
Y esto mismo os escribí, porque cuando llegare no tenga tristeza sobre tristeza de los que me debiera gozar; confiando en vosotros todos que mi gozo es el de todos vosotros.
Porque por la mucha tribulación y angustia del corazón os escribí con muchas lágrimas; no para que fueseis contristados, mas para que supieseis cuánto más amor tengo para con vosotros.
Que si alguno me contristó, no me contristó á mí, sino en parte, por no cargaros, á todos vosotros.
Bástale al tal esta reprensión hecha de muchos;
Así que, al contrario, vosotros más bien lo perdonéis y consoléis, porque no sea el tal consumido de demasiada tristeza.
Por lo cual os ruego que confirméis el amor para con él.
Porque también por este fin os escribí, para tener experiencia de vosotros si sois obedientes en todo.
Y al que vosotros perdonareis, yo también: porque también yo lo que he perdonado, si algo he perdonado, por vosotros lo he hecho en persona de Cristo;
Porque no seamos engañados de Satanás: pues no ignoramos sus maquinaciones.
Cuando vine á Troas para el evangelio de Cristo, aunque me fué abierta puerta en el Señor,
No tuve reposo en mi espíritu, por no haber hallado á Tito mi hermano: así, despidiéndome de ellos, partí para Macedonia.
Mas á Dios gracias, el cual hace que siempre triunfemos en Cristo Jesús, y manifiesta el olor de su conocimiento por nosotros en todo lugar.
Porque para Dios somos buen olor de Cristo en los que se salvan, y en los que se pierden:
A éstos ciertamente olor de muerte para muerte; y á aquéllos olor de vida para vida. Y para estas cosas ¿quién es suficiente?
Porque no somos como muchos, mercaderes falsos de la palabra de Dios: antes con sinceridad, como de Dios, delante de Dios, hablamos en Cristo.
¿COMENZAMOS otra vez á alabarnos á nosotros mismos? ¿ó tenemos necesidad, como algunos, de letras de recomendación para vosotros, ó de recomendación de vosotros?
Nuestras letras sois vosotros, escritas en nuestros corazones, sabidas y leídas de todos los hombres;
Siendo manifiesto que sois letra de Cristo administrada de nosotros, escrita no con tinta, mas con el Espíritu del Dios vivo; no en tablas de piedra, sino en tablas de carne del corazón.
Y tal confianza tenemos por Cristo para con Dios:
No que seamos suficientes de nosotros mismos para pensar algo como de nosotros mismos, sino que nuestra suficiencia es de Dios;
El cual asimismo nos hizo ministros suficientes de un nuevo pacto: no de la letra, mas del espíritu; porque la letra mata, mas el espíritu vivifica.
¿Cómo no será más bien con gloria el ministerio del espíritu?
Porque si el ministerio de condenación fué con gloria, mucho más abundará en gloria el ministerio de justicia.
Porque aun lo que fué glorioso, no es glorioso en esta parte, en comparación de la excelente gloria.
Porque si lo que perece tuvo gloria, mucho más será en gloria lo que permanece.
Así que, teniendo tal esperanza, hablamos con mucha confianza;
Y no como Moisés, que ponía un velo sobre su faz, para que los hijos de Israel no pusiesen los ojos en el fin de lo que había de ser abolido.
Empero los sentidos de ellos se embotaron; porque hasta el día de hoy les queda el mismo velo no descubierto en la lección del antiguo testamento, el cual por Cristo es quitado.
Y aun hasta el día de hoy, cuando Moisés es leído, el velo está puesto sobre el corazón de ellos.
Mas cuando se convirtieren al Señor, el velo se quitará.
Porque el Señor es el Espíritu; y donde hay el Espíritu del Señor, allí hay libertad.
Por tanto, nosotros todos, mirando á cara descubierta como en un espejo la gloria del Señor, somos transformados de gloria en gloria en la misma semejanza, como por el Espíritu del Señor.
POR lo cual teniendo nosotros esta administración según la misericordia que hemos alcanzado, no desmayamos;
Que si nuestro evangelio está aún encubierto, entre los que se pierden está encubierto:
En los cuales el dios de este siglo cegó los entendimientos de los incrédulos, para que no les resplandezca la lumbre del evangelio de la gloria de Cristo, el cual es la imagen de Dios.
Porque no nos predicamos á nosotros mismos, sino á Jesucristo, el Señor; y nosotros vuestros siervos por Jesús.
Porque Dios, que mandó que de las tinieblas resplandeciese la luz, es el que resplandeció en nuestros corazones, para iluminación del conocimiento de la gloria de Dios en la faz de Jesucristo.
Tenemos empero este tesoro en vasos de barro, para que la alteza del poder sea de Dios, y no de nosotros:
Estando atribulados en todo, mas no angustiados; en apuros, mas no desesperamos;
Perseguidos, mas no desamparados; abatidos, mas no perecemos;
Llevando siempre por todas partes la muerte de Jesús en el cuerpo, para que también la vida de Jesús sea manifestada en nuestros cuerpos.
Porque nosotros que vivimos, siempre estamos entregados á muerte por Jesús, para que también la vida de Jesús sea manifestada en nuestra carne mortal.
De manera que la muerte obra en nosotros, y en vosotros la vida.
Empero teniendo el mismo espíritu de fe, conforme á lo que está escrito: Creí, por lo cual también hablé: nosotros también creemos, por lo cual también hablamos;
Estando ciertos que el que levantó al Señor Jesús, á nosotros también nos levantará por Jesús, y nos pondrá con vosotros.
Porque todas estas cosas padecemos por vosotros, para que abundando la gracia por muchos, en el hacimiento de gracias sobreabunde á gloria de Dios.
Por tanto, no desmayamos: antes aunque este nuestro hombre exterior se va desgastando, el interior empero se renueva de día en día.
Porque lo que al presente es momentáneo y leve de nuestra tribulación, nos obra un sobremanera alto y eterno peso de gloria;
No mirando nosotros á las cosas que se ven, sino á las que no se ven: porque las cosas que se ven son temporales, mas las que no se ven son eternas.
PORQUE sabemos, que si la casa terrestre de nuestra habitación se deshiciere, tenemos de Dios un edificio, una casa no hecha de manos, eterna en los cielos.
Y por esto también gemimos, deseando ser sobrevestidos de aquella nuestra habitación celestial;
Puesto que en verdad habremos sido hallados vestidos, y no desnudos.
Porque asimismo los que estamos en este tabernáculo, gemimos agravados; porque no quisiéramos ser desnudados, sino sobrevestidos, para que lo mortal sea absorbido por la vida.
Mas el que nos hizo para esto mismo, es Dios; el cual nos ha dado la prenda del Espíritu.
Así quevivimosconfiados siempre, y sabiendo, que entre tanto que estamos en el cuerpo, peregrinamosausentesdel Señor;
(Porque por fe andamos, no por vista;)
Mas confiamos, y más quisiéramos partir del cuerpo, y estar presentes al Señor.
Por tanto procuramos también, ó ausentes, ó presentes, serle agradables:
Porque es menester que todos nosotros parezcamos ante el tribunal de Cristo, para que cada uno reciba según lo que hubiere hecho por medio del cuerpo, oraseabueno ó malo.
Estando pues poseídos del temor del Señor, persuadimos á los hombres, mas á Dios somos manifiestos; y espero que también en vuestras conciencias somos manifiestos.
No nos encomendamos pues otra vez á vosotros, sino os damos ocasión de gloriaros por nosotros, para que tengáis qué responder contra los que se glorían en las apariencias, y no en el corazón.
Porque si loqueamos, es para Dios; y si estamos en seso, es para vosotros.
Porque el amor de Cristo nos constriñe, pensando esto: Que si uno murió por todos, luego todos son muertos;
Y por todos murió, para que los que viven, ya no vivan para sí, mas para aquel que murió y resucitó por ellos.
De manera que nosotros de aquí adelante á nadie conocemos según la carne: y aun si á Cristo conocimos según la carne, empero ahora ya no le conocemos.
De modo que si alguno está en Cristo, nueva criatura es: las cosas viejas pasaron; he aquí todas son hechas nuevas.
Y todo esto es de Dios, el cual nos reconcilió á sí por Cristo; y nos dió el ministerio de la reconciliación.
Porque ciertamente Dios estaba en Cristo reconciliando el mundo á sí, no imputándole sus pecados, y puso en nosotros la palabra de la reconciliación.
Así que, somos embajadores en nombre de Cristo, como si Dios rogase por medio nuestro; os rogamos en nombre de Cristo: Reconciliaos con Dios.
Al que no conoció pecado, hizo pecado por nosotros, para que nosotros fuésemos hechos justicia de Dios en él.
Y ASÍnosotros, comoayudadores juntamente con él, os exhortamos también á que no recibáis en vano la gracia de Dios,
(Porque dice: En tiempo aceptable te he oído, y en día de salud te he socorrido: he aquí ahora el tiempo aceptable; he aquí ahora el día de salud:)
No dando á nadie ningún escándalo, porque el ministerio nuestro no sea vituperado:
Antes habiéndonos en todas cosas como ministros de Dios, en mucha paciencia, en tribulaciones, en necesidades, en angustias;
En azotes, en cárceles, en alborotos, en trabajos, en vigilias, en ayunos;
En castidad, en ciencia, en longanimidad, en bondad, en Espíritu Santo, en amor no fingido;
En palabra de verdad, en potencia de Dios, en armas de justicia á diestro y á siniestro;
Por honra y por deshonra, por infamia y por buena fama; como engañadores, mas hombres de verdad;
Como ignorados, mas conocidos; como muriendo, mas he aquí vivimos; como castigados, mas no muertos;
Como doloridos, mas siempre gozosos; como pobres, mas enriqueciendo á muchos; como no teniendo nada, mas poseyéndolo todo.
Nuestra boca está abierta á vosotros, oh Corintios: nuestro corazón es ensanchado.
No estáis estrechos en nosotros, mas estáis estrechos en vuestras propias entrañas.
Pues, para corresponder al propio modo (como á hijos hablo), ensanchaos también vosotros.
No os juntéis en yugo con los infieles: porque ¿qué compañía tiene la justicia con la injusticia? ¿y qué comunión la luz con las tinieblas?
¿Y qué concordia Cristo con Belial? ¿ó qué parte el fiel con el infiel?
¿Y qué concierto el templo de Dios con los ídolos? porque vosotros sois el templo del Dios viviente, como Dios dijo: Habitaré y andaré en ellos; y seré el Dios de ellos, y ellos serán mi pueblo.
Por lo cual salid de en medio de ellos, y apartaos, dice el Señor, y no toquéis lo inmundo; y yo os recibiré,
Y seré á vosotros Padre, y vosotros me seréis á mí hijos é hijas, dice el Señor Todopoderoso.
ASÍ que, amados, pues tenemos tales promesas, limpiémonos de toda inmundicia de carne y de espíritu, perfeccionando la santificación en temor de Dios.
Admitidnos: á nadie hemos injuriado, á nadie hemos corrompido, á nadie hemos engañado.
No para condenaroslo digo; que ya he dicho antes que estáis en nuestros corazones, para morir y para vivir juntamente.
Mucha confianza tengo de vosotros, tengo de vosotros mucha gloria; lleno estoy de consolación, sobreabundo de gozo en todas nuestras tribulaciones.
Porque aun cuando vinimos á Macedonia, ningún reposo tuvo nuestra carne; antes, en todo fuimos atribulados: de fuera, cuestiones; de dentro, temores.
Mas Dios, que consuela á los humildes, nos consoló con la venida de Tito:
Porque aunque os contristé por la carta, no me arrepiento, bien que me arrepentí; porque veo que aquella carta, aunque por algún tiempo os contristó,
Porque el dolor que es según Dios, obra arrepentimiento saludable, de que no hay que arrepentirse; mas el dolor del siglo obra muerte.
Así que, aunque os escribí, no fué por causa del que hizo la injuria, ni por causa del que la padeció, mas para que os fuese manifiesta nuestra solicitud que tenemos por vosotros delante de Dios.
Por tanto, tomamos consolación de vuestra consolación: empero mucho más nos gozamos por el gozo de Tito, que haya sido recreado su espíritu de todos vosotros.
Y sus entrañas son más abundantes para con vosotros, cuando se acuerda de la obediencia de todos vosotros, de cómo lo recibisteis con temor y temblor.
Me gozo de que en todo estoy confiado de vosotros.
ASIMISMO, hermanos, os hacemos saber la gracia de Dios que ha sido dada á las iglesias de Macedonia:
Que en grande prueba de tribulación, la abundancia de su gozo y su profunda pobreza abundaron en riquezas de su bondad.
Pues de su gradohan dadoconforme á sus fuerzas, yo testifico, y aun sobre sus fuerzas;
Pidiéndonos con muchos ruegos, que aceptásemos la gracia y la comunicación del servicio para los santos.
Y no comoloesperábamos, mas aun á sí mismos se dieron primeramente al Señor, y á nosotros por la voluntad de Dios.
De manera que exhortamos á Tito, que como comenzó antes, así también acabe esta gracia entre vosotros también.
Por tanto, como en todo abundáis, en fe, y en palabra, y en ciencia, y en toda solicitud, y en vuestro amor para con nosotros, que también abundéis en esta gracia.
No hablo como quien manda, sino para poner á prueba, por la eficacia de otros, la sinceridad también de la caridad vuestra.
Porque ya sabéis la gracia de nuestro Señor Jesucristo, que por amor de vosotros se hizo pobre, siendo rico; para que vosotros con su pobreza fueseis enriquecidos.
Y en esto doy mi consejo; porque esto os conviene á vosotros, que comenzasteis antes, no sólo á hacerlo, mas aun á quererlo desde el año pasado.
Ahora pues, llevad también á cabo el hecho, para que como estuvisteis prontos á querer, así también lo estéis en cumplir conforme á lo que tenéis.
Porque si primero hay la voluntad pronta, será acepta por lo que tiene, no por lo que no tiene.
Porque no digo esto para que haya para otros desahogo, y para vosotros apretura;
Sino para que en este tiempo, con igualdad, vuestra abundancia supla la falta de ellos, para que también la abundancia de ellos supla vuestra falta, porque haya igualdad;
Como está escrito: El que recogió mucho, no tuvo más; y el que poco, no tuvo menos.
Empero gracias á Dios que dió la misma solicitud por vosotros en el corazón de Tito.
Pues á la verdad recibió la exhortación; mas estando también muy solícito, de su voluntad partió para vosotros.
Y enviamos juntamente con él al hermano cuya alabanza en el evangelio es por todas las iglesias;
Evitando que nadie nos vitupere en esta abundancia que ministramos;
Procurando las cosas honestas, no sólo delante del Señor, mas aun delante de los hombres.
Enviamos también con ellos á nuestro hermano, al cual muchas veces hemos experimentado diligente, mas ahora mucho más con la mucha confianza que tiene en vosotros.
Ora en orden á Tito, es mi compañero y coadjutor para con vosotros; ó acerca de nuestros hermanos, los mensajeros son de las iglesias, y la gloria de Cristo.
Mostrad pues, para con ellos á la faz de las iglesias la prueba de vuestro amor, y de nuestra gloria acerca de vosotros.
PORQUE cuanto á la suministración para los santos, por demás me es escribiros;
Pues conozco vuestro pronto ánimo, del cual me glorío yo entre los de Macedonia, que Acaya está apercibida desde el año pasado; y vuestro ejemplo ha estimulado á muchos.
Mas he enviado los hermanos, porque nuestra gloria de vosotros no sea vana en esta parte; para que, como lo he dicho, estéis apercibidos;
No sea que, si vinieren conmigo Macedonios, y os hallaren desapercibidos, nos avergoncemos nosotros, por no decir vosotros, de este firme gloriarnos.
Esto empero digo: El que siembra escasamente, también segará escasamente; y el que siembra en bendiciones, en bendiciones también segará.
Cada uno dé como propuso en su corazón: no con tristeza, ó por necesidad; porque Dios ama el dador alegre.
Y poderoso es Dios para hacer que abunde en vosotros toda gracia; á fin de que, teniendo siempre en todas las cosas todo lo que basta, abundéis para toda buena obra:
Como está escrito: Derramó, dió á los pobres; su justicia permanece para siempre.
Y el que da simiente al que siembra, también dará pan para comer, y multiplicará vuestra sementera, y aumentará los crecimientos de los frutos de vuestra justicia;
Para que estéis enriquecidos en todo para toda bondad, la cual obra por nosotros hacimiento de gracias á Dios.
Porque la suministración de este servicio, no solamente suple lo que á los santos falta, sino también abunda en muchos hacimientos de gracias á Dios:
Que por la experiencia de esta suministración glorifican á Dios por la obediencia que profesáis al evangelio de Cristo, y por la bondad de contribuir para ellos y para todos;
Asimismo por la oración de ellos á favor vuestro, los cuales os quieren á causa de la eminente gracia de Dios en vosotros.
Gracias á Dios por su don inefable.
EMPERO yo Pablo, os ruego por la mansedumbre y modestia de Cristo, yo que presente ciertamente soy bajo entre vosotros, mas ausente soy confiado entre vosotros:
Ruego pues, que cuando estuviere presente, no tenga que ser atrevido con la confianza con que estoy en ánimo de ser resuelto para con algunos, que nos tienen como si anduviésemos según la carne.
Pues aunque andamos en la carne, no militamos según la carne,
(Porque las armas de nuestra milicia no son carnales, sino poderosas en Dios para la destrucción de fortalezas;)
Destruyendo consejos, y toda altura que se levanta contra la ciencia de Dios, y cautivando todo intento á la obediencia de Cristo;
Y estando prestos para castigar toda desobediencia, cuando vuestra obediencia fuere cumplida.
Porque aunque me gloríe aún un poco de nuestra potestad (la cual el Señor nos dió para edificación y no para vuestra destrucción), no me avergonzaré;
Porque no parezca como que os quiero espantar por cartas.
Porque á la verdad, dicen, las cartas son graves y fuertes; mas la presencia corporal flaca, y la palabra menospreciable.
Esto piense el tal, que cuales somos en la palabra por cartas estando ausentes, tales seremos también en hechos, estando presentes.
Nosotros empero, no nos gloriaremos fuera de nuestra medida, sino conforme á la medida de la regla, de la medida que Dios nos repartió, para llegar aun hasta vosotros.
Porque no nos extendemos sobre nuestra medida, como si no llegásemos hasta vosotros: porque también hasta vosotros hemos llegado en el evangelio de Cristo:
No gloriándonos fuera de nuestra medida en trabajos ajenos; mas teniendo esperanza del crecimiento de vuestra fe, que seremos muy engrandecidos entre vosotros, conforme á nuestra regla.
Y que anunciaremos el evangelio en los lugares más allá de vosotros, sin entrar en la medida de otro para gloriarnos en lo que ya estaba aparejado.
Mas el que se gloría, gloríese en el Señor.
Porque no el que se alaba á sí mismo, el tal es aprobado; mas aquel á quien Dios alaba.
OJALÁ toleraseis un poco mi locura; empero toleradme.
Pues que os celo con celo de Dios; porque os he desposado á un marido, para presentaroscomouna virgen pura á Cristo.
Mas temo que como la serpiente engañó á Eva con su astucia, sean corrompidos así vuestros sentidos en alguna manera, de la simplicidad que es en Cristo.
Cierto pienso que en nada he sido inferior á aquellos grandes apóstoles.
Porque aunque soy basto en la palabra, empero no en la ciencia: mas en todo somos ya del todo manifiestos á vosotros.
¿Pequé yo humillándome á mí mismo, para que vosotros fueseis ensalzados, porque os he predicado el evangelio de Dios de balde?
He despojado las otras iglesias, recibiendo salario para ministraros á vosotros.
Es la verdad de Cristo en mí, que esta gloria no me será cerrada en las partes de Acaya.
¿Por qué? ¿porque no os amo? Dios lo sabe.
Mas lo que hago, haré aún, para cortar la ocasión de aquellos que la desean, á fin de que en aquello que se glorían, sean hallados semejantes á nosotros.
Porque éstos son falsos apóstoles, obreros fraudulentos, transfigurándose en apóstoles de Cristo.
Y no es maravilla, porque el mismo Satanás se transfigura en ángel de luz.
Así que, no es mucho si también sus ministros se transfiguran como ministros de justicia; cuyo fin será conforme á sus obras.
Otra vez digo: Que nadie me estime ser loco; de otra manera, recibidme como á loco, para que aun me gloríe yo un poquito.
Lo que hablo, no lo hablo según el Señor, sino como en locura, con esta confianza de gloria.
Pues que muchos se glorían según la carne, también yo me gloriaré.
Porque de buena gana toleráis los necios, siendo vosotros sabios:
Porque toleráis si alguno os pone en servidumbre, si alguno os devora, si alguno toma, si alguno se ensalza, si alguno os hiere en la cara.
Dígolo cuanto á la afrenta, como si nosotros hubiésemos sido flacos. Empero en lo que otro tuviere osadía (hablo con locura), también yo tengo osadía.
¿Son Hebreos? yo también. ¿Son Israelitas? yo también. ¿Son simiente de Abraham? también yo.
¿Son ministros de Cristo? (como poco sabio hablo) yo más: en trabajos más abundante; en azotes sin medida; en cárceles más; en muertes, muchas veces.
De los judíos cinco veces he recibido cuarenta azotes menos uno.
Tres veces he sido azotado con varas; una vez apedreado; tres veces he padecido naufragio; una noche y un día he estado en lo profundo de la mar;
En trabajo y fatiga, en muchas vigilias, en hambre y sed, en muchos ayunos, en frío y en desnudez;
Sin otras cosas además, lo que sobre mí se agolpa cada día, la solicitud de todas las iglesias.
¿Quién enferma, y yo no enfermo? ¿Quién se escandaliza, y yo no me quemo?
Si es menester gloriarse, me gloriaré yo de lo que es de mi flaqueza.
El Dios y Padre del Señor nuestro Jesucristo, que es bendito por siglos, sabe que no miento.
En Damasco, el gobernador de la provincia del rey Aretas guardaba la ciudad de los Damascenos para prenderme;
Y fuí descolgado del muro en un serón por una ventana, y escapé de sus manos.
CIERTO no me es conveniente gloriarme; mas vendré á las visiones y á las revelaciones del Señor.
Conozco á un hombre en Cristo, que hace catorce años (si en el cuerpo, no lo sé; si fuera del cuerpo, no lo sé: Dios lo sabe) fué arrebatado hasta el tercer cielo.
Y conozco tal hombre, (si en el cuerpo, ó fuera del cuerpo, no lo sé: Dios lo sabe,)
Que fué arrebatado al paraíso, donde oyó palabras secretas que el hombre no puede decir.
De este tal me gloriaré, mas de mí mismo nada me gloriaré, sino en mis flaquezas.
Por lo cual si quisiere gloriarme, no seré insensato: porque diré verdad: empero lo dejo, porque nadie piense de mí más de lo que en mí ve, ú oye de mí.
Por lo cual tres veces he rogado al Señor, que se quite de mí.
Y me ha dicho: Bástate mi gracia; porque mi potencia en la flaqueza se perfecciona. Por tanto, de buena gana me gloriaré más bien en mis flaquezas, porque habite en mí la potencia de Cristo.
Por lo cual me gozo en las flaquezas, en afrentas, en necesidades, en persecuciones, en angustias por Cristo; porque cuando soy flaco, entonces soy poderoso.
Heme hecho un necio en gloriarme: vosotros me constreñisteis; pues yo había de ser alabado de vosotros: porque en nada he sido menos que los sumos apóstoles, aunque soy nada.
Con todo esto, las señales de apóstol han sido hechas entre vosotros en toda paciencia, en señales, y en prodigios, y en maravillas.
Porque ¿qué hay en que habéis sido menos que las otras iglesias, sino en que yo mismo no os he sido carga? Perdonadme esta injuria.
Empero yo de muy buena gana despenderé y seré despendido por vuestras almas, aunque amándoos más, sea amado menos.
Mas sea así, yo no os he agravado: sino que, como soy astuto, os he tomado por engaño.
¿Acaso os he engañado por alguno de los que he enviado á vosotros?
Rogué á Tito, y envié con él al hermano. ¿Os engañó quizá Tito? ¿no hemos procedido con el mismo espíritu y por las mismas pisadas?
¿Pensáis aún que nos excusamos con vosotros? Delante de Dios en Cristo hablamos: mas todo, muy amados, por vuestra edificación.
ESTA tercera vez voy á vosotros. En la boca de dos ó de tres testigos consistirá todo negocio.
Pues buscáis una prueba de Cristo que habla en mí, el cual no es flaco para con vosotros, antes es poderoso en vosotros.
Porque aunque fué crucificado por flaqueza, empero vive por potencia de Dios. Pues también nosotros somos flacos con él, mas viviremos con él por la potencia de Dios para con vosotros.
Examinaos á vosotros mismos si estáis en fe; probaos á vosotros mismos. ¿No os conocéis á vosotros mismos, que Jesucristo está en vosotros? si ya no sois reprobados.
Mas espero que conoceréis que nosotros no somos reprobados.
Y oramos á Dios que ninguna cosa mala hagáis; no para que nosotros seamos hallados aprobados, mas para que vosotros hagáis lo que es bueno, aunque nosotros seamos como reprobados.
Porque ninguna cosa podemos contra la verdad, sino por la verdad.
Por lo cual nos gozamos que seamos nosotros flacos, y que vosotros estéis fuertes; y aun deseamos vuestra perfección.
Por tanto os escribo esto ausente, por no tratar presente con dureza, conforme á la potestad que el Señor me ha dado para edificación, y no para destrucción.
Resta, hermanos, que tengáis gozo, seáis perfectos, tengáis consolación, sintáis una misma cosa, tengáis paz; y el Dios de paz y de caridad será con vosotros.
Saludaos los unos á los otros con ósculo santo. Todos los santos os saludan.
PABLO, apóstol, (no de los hombres, ni por hombre, mas por Jesucristo y por Dios el Padre, que lo resucitó de los muertos),
Y todos los hermanos que están conmigo, á las iglesias de Galacia:
Graciaseaá vosotros, y paz de Dios el Padre, y de nuestro Señor Jesucristo,
El cual se dió á sí mismo por nuestros pecados para librarnos de este presente siglo malo, conforme á la voluntad de Dios y Padre nuestro;
Al cualseala gloria por siglos de siglos. Amén.
Estoy maravillado de que tan pronto os hayáis traspasado del que os llamó á la gracia de Cristo, á otro evangelio:
No que hay otro, sino que hay algunos que os inquietan, y quieren pervertir el evangelio de Cristo.
Mas aun si nosotros ó un ángel del cielo os anunciare otro evangelio del que os hemos anunciado, sea anatema.
Como antes hemos dicho, también ahora decimos otra vez: Si alguno os anunciare otro evangelio del que habéis recibido, sea anatema.
Porque, ¿persuado yo ahora á hombres ó á Dios? ¿ó busco de agradar á hombres? Cierto, que si todavía agradara á los hombres, no sería siervo de Cristo.
Mas os hago saber, hermanos, que el evangelio que ha sido anunciado por mí, no es según hombre;
Pues ni yo lo recibí, ni lo aprendí de hombre, sino por revelación de Jesucristo.
Porque ya habéis oído acerca de mi conducta otro tiempo en el Judaismo, que perseguía sobremanera la iglesia de Dios, y la destruía;
Y aprovechaba en el Judaismo sobre muchos de mis iguales en mi nación, siendo muy más celador que todos de las tradiciones de mis padres.
Mas cuando plugo á Dios, que me apartó desde el vientre de mi madre, y me llamó por su gracia,
Revelar á su Hijo en mí, para que le predicase entre los Gentiles, luego no conferí con carne y sangre;
Ni fuí á Jerusalem á los que eran apóstoles antes que yo; sino que me fuí á la Arabia, y volví de nuevo á Damasco.
Después, pasados tres años, fuí á Jerusalem á ver á Pedro, y estuve con él quince días.
Mas á ningún otro de los apóstoles vi, sino á Jacobo el hermano del Señor.
Y en esto que os escribo, he aquí, delante de Dios, no miento.
Después fuí á las partes de Siria y de Cilicia;
Y no era conocido de vista á las iglesias de Judea, que eran en Cristo;
Solamente habían oído decir: Aquel que en otro tiempo nos perseguía, ahora anuncia la fe que en otro tiempo destruía.
Y glorificaban á Dios en mí.
DESPUÉS, pasados catorce años, fuí otra vez á Jerusalem juntamente con Bernabé, tomando también conmigo á Tito.
Empero fuí por revelación, y comuniquéles el evangelio que predico entre los Gentiles; mas particularmente á los que parecían ser algo, por no correr en vano, ó haber corrido.
Mas ni aun Tito, que estaba conmigo, siendo Griego, fué compelido á circuncidarse.
Y eso por causa de los falsos hermanos, que se entraban secretamente para espiar nuestra libertad que tenemos en Cristo Jesús, para ponernos en servidumbre;
A los cuales ni aun por una hora cedimos sujetándonos, para que la verdad del evangelio permaneciese con vosotros.
Empero de aquellos que parecían ser algo (cuáles hayan sido algún tiempo, no tengo que ver; Dios no acepta apariencia de hombre), á mí ciertamente los que parecían ser algo, nada me dieron.
Antes por el contrario, como vieron que el evangelio de la incircuncisión me era encargado, como á Pedro el de la circuncisión,
(Porque el que hizo por Pedro para el apostolado de la circuncisión, hizo también por mí para con los Gentiles;)
Solamente nos pidieron que nos acordásemos de los pobres; lo mismo que fuí también solícito en hacer.
Empero viniendo Pedro á Antioquía, le resistí en la cara, porque era de condenar.
Porque antes que viniesen unos de parte de Jacobo, comía con los Gentiles; mas después que vinieron, se retraía y apartaba, teniendo miedo de los que eran de la circuncisión.
Y á su disimulación consentían también los otros Judíos; de tal manera que aun Bernabé fué también llevado de ellos en su simulación.
Nosotros Judíos naturales, y no pecadores de los Gentiles,
Y si buscando nosotros ser justificados en Cristo, también nosotros somos hallados pecadores, ¿es por eso Cristo ministro de pecado? En ninguna manera.
Porque si las cosas que destruí, las mismas vuelvo á edificar, transgresor me hago.
Porque yo por la ley soy muerto á la ley, para vivir á Dios.
No desecho la gracia de Dios: porque si por la ley fuese la justicia, entonces por demás murió Cristo.
¡OH Gálatas insensatos! ¿quién os fascinó, para no obedecer á la verdad, ante cuyos ojos Jesucristo fué ya descrito como crucificado entre vosotros?
Esto solo quiero saber de vosotros: ¿Recibisteis el Espíritu por las obras de la ley, ó por el oir de la fe?
¿Tan necios sois? ¿habiendo comenzado por el Espíritu, ahora os perfeccionáis por la carne?
¿Tantas cosas habéis padecido en vano? si empero en vano.
Aquel, pues, que os daba el Espíritu, y obraba maravillas entre vosotros ¿hacíalo por las obras de la ley, ó por el oir de la fe?
Como Abraham creyó á Dios, y le fué imputado á justicia.
Sabéis por tanto, que los que son de fe, los tales son hijos de Abraham.
Y viendo antes la Escritura que Dios por la fe había de justificar á los Gentiles, evangelizó antes á Abraham, diciendo: En ti serán benditas todas las naciones.
Luego los de la fe son benditos con el creyente Abraham.
Mas por cuanto por la ley ninguno se justifica para con Dios, queda manifiesto: Que el justo por la fe vivirá.
La ley también no es de la fe; sino, El hombre que los hiciere, vivirá en ellos.
Cristo nos redimió de la maldición de la ley, hecho por nosotros maldición; (porque está escrito: Maldito cualquiera que es colgado en madero:)
Para que la bendición de Abraham fuese sobre los Gentiles en Cristo Jesús; para que por la fe recibamos la promesa del Espíritu.
Hermanos, hablo como hombre: Aunque un pacto sea de hombre, con todo, siendo confirmado, nadie lo cancela, ó le añade.
A Abraham fueron hechas las promesas, y á su simiente. No dice: Y á las simientes, como de muchos; sino como de uno: Y á tu simiente, la cual es Cristo.
Esto pues digo: Que el contrato confirmado de Dios para con Cristo, la ley que fué hecha cuatrocientos treinta años después, no lo abroga, para invalidar la promesa.
Porque si la herencia es por la ley, ya no es por la promesa: empero Dios por la promesa hizo la donación á Abraham.
¿Pues de qué sirve la ley? Fué puesta por causa de las rebeliones, hasta que viniese la simiente á quien fué hecha la promesa, ordenada aquélla por los ángeles en la mano de un mediador.
Y el mediador no es de uno, pero Dios es uno.
¿Luego la ley es contra las promesas de Dios? En ninguna manera: porque si la ley dada pudiera vivificar, la justicia fuera verdaderamente por la ley.
Mas encerró la Escritura todo bajo pecado, para que la promesa fuese dada á los creyentes por la fe de Jesucristo.
Empero antes que viniese la fe, estábamos guardados bajo la ley, encerrados para aquella fe que había de ser descubierta.
De manera que la ley nuestro ayo fué para llevarnos á Cristo, para que fuésemos justificados por la fe.
Mas venida la fe, ya no estamos bajo ayo;
Porque todos sois hijos de Dios por la fe en Cristo Jesús.
Porque todos los que habéis sido bautizados en Cristo, de Cristo estáis vestidos.
No hay Judío, ni Griego; no hay siervo, ni libre; no hay varón, ni hembra: porque todos vosotros sois uno en Cristo Jesús.
Y si vosotros sois de Cristo, ciertamente la simiente de Abraham sois, y conforme á la promesa los herederos.
TAMBIÉN digo: Entre tanto que el heredero es niño, en nada difiere del siervo, aunque es señor de todo;
Mas está debajo de tutores y curadores hasta el tiempo señalado por el padre.
Así también nosotros, cuando éramos niños, éramos siervos bajo los rudimentos del mundo.
Mas venido el cumplimiento del tiempo, Dios envió su Hijo, hecho de mujer, hecho súbdito á la ley,
Para que redimiese á los que estaban debajo de la ley, á fin de que recibiésemos la adopción de hijos.
Y por cuanto sois hijos, Dios envió el Espíritu de su Hijo en vuestros corazones, el cual clama: Abba, Padre.
Así que ya no eres más siervo, sino hijo; y si hijo, también heredero de Dios por Cristo.
Antes, en otro tiempo, no conociendo á Dios, servíais á los que por naturaleza no son dioses:
Mas ahora, habiendo conocido á Dios, ó más bien, siendo conocidos de Dios, ¿cómo os volvéis de nuevo á los flacos y pobres rudimentos, en los cuales queréis volver á servir?
Guardáis los días, y los meses, y los tiempos, y los años.
Temo de vosotros, que no haya trabajado en vano en vosotros.
Hermanos, os ruego, sed como yo, porque yo soy como vosotros: ningún agravio me habéis hecho.
Que vosotros sabéis que por flaqueza de carne os anuncié el evangelio al principio:
Y no desechasteis ni menospreciasteis mi tentación que estaba en mi carne: antes me recibisteis como á un ángel de Dios, como á Cristo Jesús.
¿Dónde está pues vuestra bienaventuranza? porque yo os doy testimonio que si se pudiera hacer, os hubierais sacado vuestros ojos para dármelos.
¿Heme pues hecho vuestro enemigo, diciéndoos la verdad?
Tienen celos de vosotros, pero no bien: antes os quieren echar fuera para que vosotros los celéis á ellos.
Bueno es ser celosos en bien siempre; y no solamente cuando estoy presente con vosotros.
Hijitos míos, que vuelvo otra vez á estar de parto de vosotros, hasta que Cristo sea formado en vosotros;
Querría cierto estar ahora con vosotros, y mudar mi voz; porque estoy perplejo en cuanto á vosotros.
Decidme, los que queréis estar debajo de la ley, ¿no habéis oído la ley?
Porque escrito está que Abraham tuvo dos hijos; uno de la sierva, el otro de la libre.
Mas el de la sierva nació según la carne; pero el de la libre nació por la promesa.
Las cuales cosas son dichas por alegoría: porque estas mujeres son los dos pactos; el uno ciertamente del monte Sinaí, el cual engendró para servidumbre, que es Agar.
Porque Agar ó Sinaí es un monte de Arabia, el cual es conjunto á la que ahora es Jerusalem, la cual sirve con sus hijos.
Mas la Jerusalem de arriba libre es; la cual es la madre de todos nosotros.
Porque está escrito: Alégrate, estéril, que no pares: prorrumpe y clama, la que no estás de parto; porque más son los hijos de la dejada, que de la que tiene marido.
Así que, hermanos, nosotros como Isaac somos hijos de la promesa.
Empero como entonces el que era engendrado según la carne, perseguía al que había nacido según el Espíritu, así también ahora.
Mas ¿qué dice la Escritura? Echa fuera á la sierva y á su hijo; porque no será heredero el hijo de la sierva con el hijo de la libre.
De manera, hermanos, que no somos hijos de la sierva, mas de la libre.
ESTAD, pues, firmes en la libertad con que Cristo nos hizo libres, y no volváis otra vez á ser presos en el yugo de servidumbre.
He aquí yo Pablo os digo, que si os circuncidareis, Cristo no os aprovechará nada.
Y otra vez vuelvo á protestar á todo hombre que se circuncidare, que está obligado á hacer toda la ley.
Vacíos sois de Cristo los que por la ley os justificáis; de la gracia habéis caído.
Porque nosotros por el Espíritu esperamos la esperanza de la justicia por la fe.
Porque en Cristo Jesús ni la circuncisión vale algo, ni la incircuncisión; sino la fe que obra por la caridad.
Vosotros corríais bien: ¿quién os embarazó para no obedecer á la verdad?
Esta persuasión no es de aquel que os llama.
Un poco de levadura leuda toda la masa.
Yo confío de vosotros en el Señor, que ninguna otra cosa sentiréis: mas el que os inquieta, llevará el juicio, quienquiera que él sea.
Y yo, hermanos, si aun predico la circuncisión, ¿por qué padezco persecución todavía? pues que quitado es el escándalo de la cruz.
Ojalá fuesen también cortados los que os inquietan.
Porque vosotros, hermanos, á libertad habéis sido llamados; solamente que no uséis la libertad como ocasión á la carne, sino servíos por amor los unos á los otros.
Porque toda la ley en aquesta sola palabra se cumple: Amarás á tu prójimo como á ti mismo.
Y si os mordéis y os coméis los unos á los otros, mirad que también no os consumáis los unos á los otros.
Digo pues: Andad en el Espíritu, y no satisfagáis la concupiscencia de la carne.
Porque la carne codicia contra el Espíritu, y el Espíritu contra la carne: y estas cosas se oponen la una á la otra, para que no hagáis lo que quisiereis.
Mas si sois guiados del Espíritu, no estáis bajo la ley.
Y manifiestas son las obras de la carne, que son: adulterio, fornicación, inmundicia, disolución,
Idolatría, hechicerías, enemistades, pleitos, celos, iras, contiendas, disensiones, herejías,
Envidias, homicidios, borracheras, banqueteos, y cosas semejantes á éstas: de las cuales os denuncio, como ya os he anunciado, que los que hacen tales cosas no heredarán el reino de Dios.
Mas el fruto del Espíritu es: caridad, gozo, paz, tolerancia, benignidad, bondad, fe,
Mansedumbre, templanza: contra tales cosas no hay ley.
Porque los que son de Cristo, han crucificado la carne con los afectos y concupiscencias.
Si vivimos en el Espíritu, andemos también en el Espíritu.
No seamos codiciosos de vana gloria, irritando los unos á los otros, envidiándose los unos á los otros.
HERMANOS, si alguno fuere tomado en alguna falta, vosotros que sois espirituales, restaurad al tal con el espíritu de mansedumbre; considerándote á ti mismo, porque tú no seas también tentado.
Sobrellevad los unos las cargas de los otros; y cumplid así la ley de Cristo.
Porque el que estima de sí que es algo, no siendo nada, á sí mismo se engaña.
Así que cada uno examine su obra, y entonces tendrá gloria sólo respecto de sí mismo, y no en otro.
Porque cada cual llevará su carga.
Y el que es enseñado en la palabra, comunique en todos los bienes al que lo instruye.
No os engañéis: Dios no puede ser burlado: que todo lo que el hombre sembrare, eso también segará.
Porque el que siembra para su carne, de la carne segará corrupción; mas el que siembra para el Espíritu, del Espíritu segará vida eterna.
No nos cansemos, pues, de hacer bien; que á su tiempo segaremos, si no hubiéremos desmayado.
Así que, entre tanto que tenemos tiempo, hagamos bien á todos, y mayormente á los domésticos de la fe.
Mirad en cuán grandes letras os he escrito de mi mano.
Todos los que quieren agradar en la carne, éstos os constriñen á que os circuncidéis, solamente por no padecer persecución por la cruz de Cristo.
Porque ni aun los mismos que se circuncidan guardan la ley; sino que quieren que vosotros seáis circuncidados, para gloriarse en vuestra carne.
Mas lejos esté de mí gloriarme, sino en la cruz de nuestro Señor Jesucristo, por el cual el mundo me es crucificado á mí, y yo al mundo.
Porque en Cristo Jesús, ni la circuncisión vale nada, ni la incircuncisión, sino la nueva criatura.
Y todos los que anduvieren conforme á esta regla, paz sobre ellos, y misericordia, y sobre el Israel de Dios.
De aquí adelante nadie me sea molesto; porque yo traigo en mi cuerpo las marcas del Señor Jesús.
Hermanos, la gracia de nuestro Señor Jesucristo sea con vuestro espíritu. Amén. Enviada de Roma á los Gálatas.
PABLO, apóstol de Jesucristo por la voluntad de Dios, á los santos y fieles en Cristo Jesús que están en Efeso:
Graciaseaá vosotros, y paz de Dios Padre nuestro, y del Señor Jesucristo.
Bendito el Dios y Padre del Señor nuestro Jesucristo, el cual nos bendijo con toda bendición espiritual enlugarescelestiales en Cristo:
Según nos escogió en él antes de la fundación del mundo, para que fuésemos santos y sin mancha delante de él en amor;
Habiéndonos predestinado para ser adoptados hijos por Jesucristo á sí mismo, según el puro afecto de su voluntad,
Para alabanza de la gloria de su gracia, con la cual nos hizo aceptos en el Amado:
En el cual tenemos redención por su sangre, la remisión de pecados por las riquezas de su gracia,
Que sobreabundó en nosotros en toda sabiduría é inteligencia;
Descubriéndonos el misterio de su voluntad, según su beneplácito, que se había propuesto en sí mismo,
De reunir todas las cosas en Cristo, en la dispensación del cumplimiento de los tiempos, así las que están en los cielos, como las que están en la tierra:
En él digo, en quien asimismo tuvimos suerte, habiendo sido predestinados conforme al propósito del que hace todas las cosas según el consejo de su voluntad,
Para que seamos para alabanza de su gloria, nosotros que antes esperamos en Cristo.
En el cual esperasteis también vosotros en oyendo la palabra de verdad, el evangelio de vuestra salud: en el cual también desde que creísteis, fuisteis sellados con el Espíritu Santo de la promesa,
Que es las arras de nuestra herencia, para la redención de la posesión adquirida para alabanza de su gloria.
Por lo cual también yo, habiendo oído de vuestra fe en el Señor Jesús, y amor para con todos los santos,
No ceso de dar gracias por vosotros, haciendo memoria de vosotros en mis oraciones;
Que el Dios del Señor nuestro Jesucristo, el Padre de gloria, os dé espíritu de sabiduría y de revelación para su conocimiento;
Alumbrando los ojos de vuestro entendimiento, para que sepáis cuál sea la esperanza de su vocación, y cuáles las riquezas de la gloria de su herencia en los santos,
Y cuál aquella supereminente grandeza de su poder para con nosotros los que creemos, por la operación de la potencia de su fortaleza,
La cual obró en Cristo, resucitándole de los muertos, y colocándole á su diestra en los cielos,
Sobre todo principado, y potestad, y potencia, y señorío, y todo nombre que se nombra, no sólo en este siglo, mas aun en el venidero:
Y sometió todas las cosas debajo de sus pies, y diólo por cabeza sobre todas las cosas á la iglesia,
La cual es su cuerpo, la plenitud de Aquel que hinche todas las cosas en todos.
YDE ella recibisteis vosotros, que estabais muertos en vuestros delitos y pecados,
En que en otro tiempo anduvisteis conforme á la condición de este mundo, conforme al príncipe de la potestad del aire, el espíritu que ahora obra en los hijos de desobediencia:
Empero Dios, que es rico en misericordia, por su mucho amor con que nos amó,
Aun estando nosotros muertos en pecados, nos dió vida juntamente con Cristo; por gracia sois salvos;
Y juntamente nos resucitó, y asimismo nos hizo sentar en los cielos con Cristo Jesús,
Para mostrar en los siglos venideros las abundantes riquezas de su gracia en su bondad para con nosotros en Cristo Jesús.
Porque por gracia sois salvos por la fe; y esto no de vosotros, pues es don de Dios:
No por obras, para que nadie se gloríe.
Porque somos hechura suya, criados en Cristo Jesús para buenas obras, las cuales Dios preparó para que anduviésemos en ellas.
Por tanto, acordaos que en otro tiempo vosotros los Gentiles en la carne, que erais llamados incircuncisión por la que se llama circuncisión, hecha con mano en la carne;
Que en aquel tiempo estabais sin Cristo, alejados de la república de Israel, y extranjeros á los pactos de la promesa, sin esperanza y sin Dios en el mundo.
Mas ahora en Cristo Jesús, vosotros que en otro tiempo estabais lejos, habéis sido hechos cercanos por la sangre de Cristo.
Porque él es nuestra paz, que de ambos hizo uno, derribando la pared intermedia de separación;
Dirimiendo en su carne las enemistades, la ley de los mandamientos en orden á ritos, para edificar en sí mismo los dos en un nuevo hombre, haciendo la paz,
Y reconciliar por la cruz con Dios á ambos en un mismo cuerpo, matando en ella las enemistades.
Y vino, y anunció la paz á vosotros que estabais lejos, y á los que estaban cerca:
Que por él los unos y los otros tenemos entrada por un mismo Espíritu al Padre.
Así que ya no sois extranjeros ni advenedizos, sino juntamente ciudadanos con los santos, y domésticos de Dios;
Edificados sobre el fundamento de los apóstoles y profetas, siendo la principal piedra del ángulo Jesucristo mismo;
En el cual, compaginado todo el edificio, va creciendo para ser un templo santo en el Señor:
En el cual vosotros también sois juntamente edificados, para morada de Dios en Espíritu.
POR esta causa yo Pablo, prisionero de Cristo Jesús por vosotros los Gentiles,
Si es que habéis oído la dispensación de la gracia de Dios que me ha sido dada para con vosotros,
A saber, que por revelación me fué declarado el misterio, como antes he escrito en breve;
Leyendo lo cual podéis entender cuál sea mi inteligencia en el misterio de Cristo:
El cualmisterioen los otros siglos no se dió á conocer á los hijos de los hombres como ahora es revelado á sus santos apóstoles y profetas en el Espíritu:
Que los Gentiles sean juntamente herederos, é incorporados, y consortes de su promesa en Cristo por el evangelio:
Del cual yo soy hecho ministro por el don de la gracia de Dios que me ha sido dado según la operación de su potencia.
A mí, que soy menos que el más pequeño de todos los santos, es dada esta gracia de anunciar entre los Gentiles el evangelio de las inescrutables riquezas de Cristo,
Y de aclarar á todos cuál sea la dispensación del misterio escondido desde los siglos en Dios, que crió todas las cosas.
Para que la multiforme sabiduría de Dios sea ahora notificada por la iglesia á los principados y potestades en los cielos,
Conforme á la determinación eterna, que hizo en Cristo Jesús nuestro Señor:
En el cual tenemos seguridad y entrada con confianza por la fe de él.
Por tanto, pido que no desmayéis á causa de mis tribulaciones por vosotros, las cuales son vuestra gloria.
Por esta causa doblo mis rodillas al Padre de nuestro Señor Jesucristo,
Del cual es nombrada toda la parentela en los cielos y en la tierra,
Que os dé, conforme á las riquezas de su gloria, el ser corroborados con potencia en el hombre interior por su Espíritu.
Que habite Cristo por la fe en vuestros corazones; para que, arraigados y fundados en amor,
Podáis bien comprender con todos los santos cuál sea la anchura y la longura y la profundidad y la altura,
Y conocer el amor de Cristo, que excede á todo conocimiento, para que seáis llenos de toda la plenitud de Dios.
Y á Aquel que es poderoso para hacer todas las cosas mucho más abundantemente de lo que pedimos ó entendemos, por la potencia que obra en nosotros,
A él sea gloria en la iglesia por Cristo Jesús, por todas edades del siglo de los siglos. Amén.
YO pues, preso en el Señor, os ruego que andéis como es digno de la vocación con que sois llamados;
Con toda humildad y mansedumbre, con paciencia soportando los unos á los otros en amor;
Solícitos á guardar la unidad del Espíritu en el vínculo de la paz.
Un cuerpo, y un Espíritu; como sois también llamados á una misma esperanza de vuestra vocación:
Un Señor, una fe, un bautismo,
Un Dios y Padre de todos, el cual es sobre todas las cosas, y por todas las cosas, y en todos vosotros.
Empero á cada uno de nosotros es dada la gracia conforme á la medida del don de Cristo.
Por lo cual dice: Subiendo á lo alto, llevó cautiva la cautividad, y dió dones á los hombres.
(Y que subió, ¿qué es, sino que también había descendido primero á las partes más bajas de la tierra?
El que descendió, él mismo es el que también subió sobre todos los cielos para cumplir todas las cosas.)
Y él mismo dió unos, ciertamente apóstoles; y otros, profetas; y otros, evangelistas; y otros, pastores y doctores;
Para perfección de los santos, para la obra del ministerio, para edificación del cuerpo de Cristo;
Hasta que todos lleguemos á la unidad de la fe y del conocimiento del Hijo de Dios, á un varón perfecto, á la medida de la edad de la plenitud de Cristo:
Que ya no seamos niños fluctuantes, y llevados por doquiera de todo viento de doctrina, por estratagema de hombres que, para engañar, emplean con astucia los artificios del error:
Antes siguiendo la verdad en amor, crezcamos en todas cosas en aquel que es la cabeza, á saber, Cristo;
Esto pues digo, y requiero en el Señor, que no andéis más como los otros Gentiles, que andan en la vanidad de su sentido,
Teniendo el entendimiento entenebrecido, ajenos de la vida de Dios por la ignorancia que en ellos hay, por la dureza de su corazón:
Los cuales después que perdieron el sentido de la conciencia, se entregaron á la desvergüenza para cometer con avidez toda suerte de impureza.
Mas vosotros no habéis aprendido así á Cristo:
Si empero lo habéis oído, y habéis sido por él enseñados, como la verdad está en Jesús,
A que dejéis, cuanto á la pasada manera de vivir, el viejo hombre que está viciado conforme á los deseos de error;
Y á renovaros en el espíritu de vuestra mente,
Y vestir el nuevo hombre que es criado conforme á Dios en justicia y en santidad de verdad.
Por lo cual, dejada la mentira, hablad verdad cada uno con su prójimo; porque somos miembros los unos de los otros.
Airaos, y no pequéis; no se ponga el sol sobre vuestro enojo;
Ni deis lugar al diablo.
El que hurtaba, no hurte más; antes trabaje, obrando con sus manos lo que es bueno, para que tenga de qué dar al que padeciere necesidad.
Ninguna palabra torpe salga de vuestra boca, sino la que sea buena para edificación, para que dé gracia á los oyentes.
Y no contristéis al Espíritu Santo de Dios, con el cual estáis sellados para el día de la redención.
Toda amargura, y enojo, é ira, y voces, y maledicencia sea quitada de vosotros, y toda malicia:
Antes sed los unos con los otros benignos, misericordiosos, perdonándoos los unos á los otros, como también Dios os perdonó en Cristo.
SED, pues, imitadores de Dios como hijos amados:
Y andad en amor, como también Cristo nos amó, y se entregó á sí mismo por nosotros, ofrenda y sacrificio á Dios en olor suave.
Pero fornicación y toda inmundicia, ó avaricia, ni aun se nombre entre vosotros, como conviene á santos;
Ni palabras torpes, ni necedades, ni truhanerías, que no convienen; sino antes bien acciones de gracias.
Porque sabéis esto, que ningún fornicario, ó inmundo, ó avaro, que es servidor de ídolos, tiene herencia en el reino de Cristo y de Dios.
Nadie os engañe con palabras vanas; porque por estas cosas viene la ira de Dios sobre los hijos de desobediencia.
No seáis pues aparceros con ellos;
Porque en otro tiempo erais tinieblas; mas ahora sois luz en el Señor: andad como hijos de luz,
(Porque el fruto del Espíritu es en toda bondad, y justicia, y verdad;)
Aprobando lo que es agradable al Señor.
Y no comuniquéis con las obras infructuosas de las tinieblas; sino antes bien redargüidlas.
Porque torpe cosa es aun hablar de lo que ellos hacen en oculto.
Mas todas las cosas cuando son redargüidas, son manifestadas por la luz; porque lo que manifiesta todo, la luz es.
Por lo cual dice: Despiértate, tú que duermes, y levántate de los muertos, y te alumbrará Cristo.
Mirad, pues, cómo andéis avisadamente; no como necios, mas como sabios;
Redimiendo el tiempo, porque los días son malos.
Por tanto, no seáis imprudentes, sino entendidos de cuál sea la voluntad del Señor.
Y no os embriaguéis de vino, en lo cual hay disolución; mas sed llenos de Espíritu;
Hablando entre vosotros con salmos, y con himnos, y canciones espirituales, cantando y alabando al Señor en vuestros corazones;
Dando gracias siempre de todo al Dios y Padre en el nombre de nuestro Señor Jesucristo:
Sujetados los unos á los otros en el temor de Dios.
Las casadas estén sujetas á sus propios maridos, como al Señor.
Porque el marido es cabeza de la mujer, así como Cristo es cabeza de la iglesia; y él es el que da la salud al cuerpo.
Así que, como la iglesia está sujeta á Cristo, así también las casadas lo estén á sus maridos en todo.
Maridos, amad á vuestras mujeres, así como Cristo amó á la iglesia, y se entregó á sí mismo por ella,
Para santificarla limpiándola en el lavacro del agua por la palabra,
Para presentársela gloriosa para sí, una iglesia que no tuviese mancha ni arruga, ni cosa semejante; sino que fuese santa y sin mancha.
Así también los maridos deben amar á sus mujeres como á sus mismos cuerpos. El que ama á su mujer, á sí mismo se ama.
Porque ninguno aborreció jamás á su propia carne, antes la sustenta y regala, como también Cristo á la iglesia;
Porque somos miembros de su cuerpo, de su carne y de sus huesos.
Por esto dejará el hombre á su padre y á su madre, y se allegará á su mujer, y serán dos en una carne.
Este misterio grande es: mas yo digo esto con respecto á Cristo y á la iglesia.
Cada uno empero de vosotros de por sí, ame también á su mujer como á sí mismo; y la mujer reverencie á su marido.
HIJOS, obedeced en el Señor á vuestros padres; porque esto es justo.
Honra á tu padre y á tu madre, que es el primer mandamiento con promesa,
Para que te vaya bien, y seas de larga vida sobre la tierra.
Y vosotros, padres, no provoquéis á ira á vuestros hijos; sino criadlos en disciplina y amonestación del Señor.
Siervos, obedeced á vuestros amos según la carne con temor y temblor, con sencillez de vuestro corazón, como á Cristo;
No sirviendo al ojo, como los que agradan á los hombres; sino como siervos de Cristo, haciendo de ánimo la voluntad de Dios;
Sirviendo con buena voluntad, como al Señor, y no á los hombres;
Sabiendo que el bien que cada uno hiciere, esto recibirá del Señor, sea siervo ó sea libre.
Y vosotros, amos, haced á ellos lo mismo, dejando las amenazas: sabiendo que el Señor de ellos y vuestro está en los cielos, y que no hay acepción de personas con él.
Por lo demás, hermanos míos, confortaos en el Señor, y en la potencia de su fortaleza.
Vestíos de toda la armadura de Dios, para que podáis estar firmes contra las asechanzas del diablo.
Por tanto, tomad toda la armadura de Dios, para que podáis resistir en el día malo, y estar firmes, habiendo acabado todo.
Estad pues firmes, ceñidos vuestros lomos de verdad, y vestidos de la cota de justicia,
Y calzados los pies con el apresto del evangelio de paz;
Sobre todo, tomando el escudo de la fe, con que podáis apagar todos los dardos de fuego del maligno.
Y tomad el yelmo de salud, y la espada del Espíritu; que es la palabra de Dios;
Orando en todo tiempo con toda deprecación y súplica en el Espíritu, y velando en ello con toda instancia y suplicación por todos los santos,
Y por mí, para que me sea dada palabra en el abrir de mi boca con confianza, para hacer notorio el misterio del evangelio,
Por el cual soy embajador en cadenas; que resueltamente hable de él, como debo hablar.
Mas para que también vosotros sepáis mis negocios, y cómo lo paso, todo os lo hará saber Tichîco, hermano amado y fiel ministro en el Señor:
Al cual os he enviado para esto mismo, para que entendáis lo tocante á nosotros, y que consuele vuestros corazones.
Paz sea á los hermanos y amor con fe, de Dios Padre y del Señor Jesucristo.
Gracia sea con todos los que aman á nuestro Señor Jesucristo en sinceridad. Amén. Escrita de Roma á los Efesios por Tichîco.
PABLO y Timoteo, siervos de Jesucristo, á todos los santos en Cristo Jesús que están en Filipos, con los obispos y diáconos:
Graciaseaá vosotros, y paz de Dios nuestro Padre y del Señor Jesucristo.
Doy gracias á mi Dios en toda memoria de vosotros,
Siempre en todas mis oraciones haciendo oración por todos vosotros con gozo,
Por vuestra comunión en el evangelio, desde el primer día hasta ahora:
Estando confiado de esto, que el que comenzó en vosotros la buena obra, la perfeccionará hasta el día de Jesucristo;
Porque Dios me es testigo de cómo os amo á todos vosotros en las entrañas de Jesucristo.
Y esto ruego, que vuestro amor abunde aun más y más en ciencia y en todo conocimiento,
Para que discernáis lo mejor; que seáis sinceros y sin ofensa para el día de Cristo;
Llenos de frutos de justicia, que son por Jesucristo, á gloria y loor de Dios.
Y quiero, hermanos, que sepáis que las cosas que mehan sucedido, han redundado más en provecho del evangelio;
De manera que mis prisiones han sido célebres en Cristo en todo el pretorio, y á todos los demás;
Y muchos de los hermanos en el Señor, tomando ánimo con mis prisiones, se atreven mucho más á hablar la palabra sin temor.
Y algunos, á la verdad, predican á Cristo por envidia y porfía; mas algunos también por buena voluntad.
Los unos anuncian á Cristo por contención, no sinceramente, pensando añadir aflicción á mis prisiones;
Pero los otros por amor, sabiendo que soy puesto por la defensa del evangelio.
¿Qué pues? Que no obstante, en todas maneras, ó por pretexto ó por verdad, es anunciado Cristo; y en esto me huelgo, y aun me holgaré.
Porque sé que esto se me tornará á salud, por vuestra oración, y por la suministración del Espíritu de Jesucristo;
Conforme á mi mira y esperanza, que en nada seré confundido; antes bien con toda confianza, como siempre, ahora también será engrandecido Cristo en mi cuerpo, ó por vida, ó por muerte.
Porque para mí el vivir es Cristo, y el morir es ganancia.
Mas si el vivir en la carne, esto me será para fruto de la obra, no sé entonces qué escoger;
Porque de ambas cosas estoy puesto en estrecho, teniendo deseo de ser desatado, y estar con Cristo, lo cual es mucho mejor:
Empero quedar en la carne es más necesario por causa de vosotros.
Y confiado en esto, sé que quedaré, que aun permaneceré con todos vosotros, para provecho vuestro y gozo de la fe;
Para que crezca vuestra gloria de mí en Cristo Jesús por mi venida otra vez á vosotros.
Y en nada intimidados de los que se oponen: que á ellos ciertamente es indicio de perdición, mas á vosotros de salud; y esto de Dios;
Porque á vosotros es concedido por Cristo, no sólo que creáis en él, sino también que padezcáis por él,
Teniendo el mismo conflicto que habéis visto en mí, y ahora oís estar en mí.
POR tanto, si hay alguna consolación en Cristo; si algún refrigerio de amor; si alguna comunión del Espíritu; si algunas entrañas y misericordias,
Cumplid mi gozo; que sintáis lo mismo, teniendo el mismo amor, unánimes, sintiendo una misma cosa.
Nada hagáis por contienda ó por vanagloria; antes bien en humildad, estimándoos inferiores los unos á los otros:
No mirando cada uno á lo suyo propio, sino cada cual también á lo de los otros.
Haya, pues, en vosotros este sentir que hubo también en Cristo Jesús:
El cual, siendo en forma de Dios, no tuvo por usurpación ser igual á Dios:
Sin embargo, se anonadó á sí mismo, tomando forma de siervo, hecho semejante á los hombres;
Y hallado en la condición como hombre, se humilló á sí mismo, hecho obediente hasta la muerte, y muerte de cruz.
Por lo cual Dios también le ensalzó á lo sumo, y dióle un nombre que es sobre todo nombre;
Para que en el nombre de Jesús se doble toda rodilla de los que están en los cielos, y de los que en la tierra, y de los que debajo de la tierra;
Y toda lengua confiese que Jesucristo es el Señor, á la gloria de Dios Padre.
Por tanto, amados míos, como siempre habéis obedecido, no como en mi presencia solamente, sino mucho más ahora en mi ausencia, ocupaos en vuestra salvación con temor y temblor;
Porque Dios es el que en vosotros obra así el querer como el hacer, por su buena voluntad.
Haced todo sin murmuraciones y contiendas,
Para que seáis irreprensibles y sencillos, hijos de Dios sin culpa en medio de la nación maligna y perversa, entre los cuales resplandecéis como luminares en el mundo;
Reteniendo la palabra de vida para que yo pueda gloriarme en el día de Cristo, que no he corrido en vano, ni trabajado en vano.
Y aun si soy derramado en libación sobre el sacrificio y servicio de vuestra fe, me gozo y congratulo por todos vosotros.
Y asimismo gozaos también vosotros, y regocijaos conmigo.
Mas espero en el Señor Jesús enviaros presto á Timoteo, para que yo también esté de buen ánimo, entendido vuestro estado.
Porque á ninguno tengo tan unánime, y que con sincera afición esté solícito por vosotros.
Porque todos buscan lo suyo propio, no lo que es de Cristo Jesús.
Pero la experiencia de él habéis conocido, que como hijo á padre ha servido conmigo en el evangelio.
Así que á éste espero enviaros, luego que yo viere cómo van mis negocios;
Y confío en el Señor que yo también iré presto á vosotros.
Mas tuve por cosa necesaria enviaros á Epafrodito, mi hermano, y colaborador y compañero de milicia, y vuestro mensajero, y ministrador de mis necesidades;
Porque tenía gran deseo de ver á todos vosotros, y gravemente se angustió porque habíais oído que había enfermado.
Pues en verdad estuvo enfermo á la muerte: mas Dios tuvo misericordia de él; y no solamente de él, sino aun de mí, para que yo no tuviese tristeza sobre tristeza.
Así que le envío más presto, para que viéndole os volváis á gozar, y yo esté con menos tristeza.
Recibidle pues en el Señor con todo gozo; y tened en estima á los tales:
Porque por la obra de Cristo estuvo cercano á la muerte, poniendo su vida para suplir vuestra falta en mi servicio.
RESTA, hermanos, que os gocéis en el Señor. A mí, á la verdad, no es molesto el escribiros las mismas cosas, y para vosotros es seguro.
Guardaos de los perros, guardaos de los malos obreros, guardaos del cortamiento.
Porque nosotros somos la circuncisión, los que servimos en espíritu á Dios, y nos gloriamos en Cristo Jesús, no teniendo confianza en la carne.
Aunque yo tengo también de qué confiar en la carne. Si alguno parece que tiene de qué confiar en la carne, yo más:
Circuncidado al octavo día, del linaje de Israel, de la tribu de Benjamín, Hebreo de Hebreos; cuanto á la ley, Fariseo;
Cuanto al celo, perseguidor de la iglesia; cuanto á la justicia que es en la ley, irreprensible.
Pero las cosas que para mí eran ganancias, helas reputado pérdidas por amor de Cristo.
Y ser hallado en él, no teniendo mi justicia, que es por la ley, sino la que es por la fe de Cristo, la justicia que es de Dios por la fe;
A fin de conocerle, y la virtud de su resurrección, y la participación de sus padecimientos, en conformidad á su muerte,
Si en alguna manera llegase á la resurrección de los muertos.
No que ya haya alcanzado, ni que ya sea perfecto; sino que prosigo, por ver si alcanzo aquello para lo cual fuí también alcanzado de Cristo Jesús.
Hermanos, yo mismo no hago cuenta de haberlo ya alcanzado; pero una cosa hago: olvidando ciertamente lo que queda atrás, y extendiéndome á lo que está delante,
Prosigo al blanco, al premio de la soberana vocación de Dios en Cristo Jesús.
Así que, todos los que somos perfectos, esto mismo sintamos: y si otra cosa sentís, esto también os revelará Dios.
Empero en aquello á que hemos llegado, vamos por la misma regla, sintamos una misma cosa.
Hermanos, sed imitadores de mí, y mirad los que así anduvieren como nos tenéis por ejemplo.
Porque muchos andan, de los cuales os dije muchas veces, y aun ahora lo digo llorando, que son enemigos de la cruz de Cristo:
Cuyo fin será perdición, cuyo dios es el vientre, y su gloria es en confusión; que sienten lo terreno.
Mas nuestra vivienda es en los cielos; de donde también esperamos al Salvador, al Señor Jesucristo;
El cual transformará el cuerpo de nuestra bajeza, para ser semejante al cuerpo de su gloria, por la operación con la cual puede también sujetar á sí todas las cosas.
ASÍ que, hermanos míos amados y deseados, gozo y corona mía, estad así firmes en el Señor, amados.
A Euodias ruego, y á Syntychê exhorto, que sientan lo mismo en el Señor.
Gozaos en el Señor siempre: otra vez digo: Que os gocéis.
Vuestra modestia sea conocida de todos los hombres. El Señor está cerca.
Por nada estéis afanosos; sino sean notorias vuestras peticiones delante de Dios en toda oración y ruego, con hacimiento de gracias.
Y la paz de Dios, que sobrepuja todo entendimiento, guardará vuestros corazones y vuestros entendimientos en Cristo Jesús.
Lo que aprendisteis y recibisteis y oísteis y visteis en mí, esto haced; y el Dios de paz será con vosotros.
Mas en gran manera me gocé en el Señor de que ya al fin ha reflorecido vuestro cuidado de mí; de lo cual aun estabais solícitos, pero os faltaba la oportunidad.
No lo digo en razón de indigencia, pues he aprendido á contentarme con lo que tengo.
Sé estar humillado, y sé tener abundancia: en todo y por todo estoy enseñado, así para hartura como para hambre, así para tener abundancia como para padecer necesidad.
Todo lo puedo en Cristo que me fortalece.
Sin embargo, bien hicisteis que comunicasteis juntamente á mi tribulación.
Y sabéis también vosotros, oh Filipenses, que al principio del evangelio, cuando partí de Macedonia, ninguna iglesia me comunicó en razón de dar y recibir, sino vosotros solos.
Porque aun á Tesalónica me enviasteis lo necesario una y dos veces.
No porque busque dádivas; mas busco fruto que abunde en vuestra cuenta.
Empero todo lo he recibido, y tengo abundancia: estoy lleno, habiendo recibido de Epafrodito lo que enviasteis, olor de suavidad, sacrificio acepto, agradable á Dios.
Mi Dios, pues, suplirá todo lo que os falta conforme á sus riquezas en gloria en Cristo Jesús.
Al Dios pues y Padre nuestro sea gloria por los siglos de los siglos. Amén.
Saludad á todos los santos en Cristo Jesús. Los hermanos que están conmigo os saludan.
Todos los santos os saludan, y mayormente los que son de casa de César.
La gracia de nuestro Señor Jesucristo sea con todos vosotros. Amén. Escrita de Roma con Epafrodito.
PABLO, apóstol de Jesucristo por la voluntad de Dios, y el hermano Timoteo,
A los santos y hermanos fieles en Cristo que están en Colosas: Gracia y paz á vosotros de Dios Padre nuestro, y del Señor Jesucristo.
Damos gracias al Dios y Padre del Señor nuestro Jesucristo, siempre orando por vosotros:
Habiendo oído vuestra fe en Cristo Jesús, y el amor que tenéis á todos los santos,
A causa de la esperanza que os está guardada en los cielos, de la cual habéis oído ya por la palabra verdadera del evangelio:
El cual ha llegado hasta vosotros, como por todo el mundo; y fructifica y crece, como también en vosotros, desde el día que oísteis y conocisteis la gracia de Dios en verdad,
Como habéis aprendido de Epafras, nuestro consiervo amado, el cual es un fiel ministro de Cristo á favor vuestro;
El cual también nos ha declarado vuestro amor en el Espíritu.
Por lo cual también nosotros, desde el día que lo oímos, no cesamos de orar por vosotros, y de pedir que seáis llenos del conocimiento de su voluntad, en toda sabiduría y espiritual inteligencia;
Para que andéis como es digno del Señor, agradándole en todo, fructificando en toda buena obra, y creciendo en el conocimiento de Dios:
Corroborados de toda fortaleza, conforme á la potencia de su gloria, para toda tolerancia y largura de ánimo con gozo;
Dando gracias al Padre que nos hizo aptos para participar de la suerte de los santos en luz:
Que nos ha librado de la potestad de las tinieblas, y trasladado al reino de su amado Hijo;
En el cual tenemos redención por su sangre, la remisión de pecados:
El cual es la imagen del Dios invisible, el primogénito de toda criatura.
Y él es antes de todas las cosas, y por él todas las cosas subsisten:
Y él es la cabeza del cuerpo que es la iglesia; él que es el principio, el primogénito de los muertos, para que en todo tenga el primado.
Por cuanto agradó al Padre que en él habitase toda plenitud,
Y por él reconciliar todas las cosas á sí, pacificando por la sangre de su cruz, así lo que está en la tierra como lo que está en los cielos.
A vosotros también, que erais en otro tiempo extraños y enemigos de ánimo en malas obras, ahora empero os ha reconciliado
En el cuerpo de su carne por medio de muerte, para haceros santos, y sin mancha, é irreprensibles delante de él:
Que ahora me gozo en lo que padezco por vosotros, y cumplo en mi carne lo que falta de las aflicciones de Cristo por su cuerpo, que es la iglesia;
De la cual soy hecho ministro, según la dispensación de Dios que me fué dada en orden á vosotros, para que cumpla la palabra de Dios;
A saber, el misterio que había estado oculto desde los siglos y edades, mas ahora ha sido manifestado á sus santos:
A los cuales quiso Dios hacer notorias las riquezas de la gloria de este misterio entre los Gentiles; que es Cristo en vosotros la esperanza de gloria:
El cual nosotros anunciamos, amonestando á todo hombre, y enseñando en toda sabiduría, para que presentemos á todo hombre perfecto en Cristo Jesús:
En lo cual aun trabajo, combatiendo según la operación de él, la cual obra en mí poderosamente.
PORQUE quiero que sepáis cuán gran solicitud tengo por vosotros, y por los que están en Laodicea, y por todos los que nunca vieron mi rostro en carne;
En el cual están escondidos todos los tesoros de sabiduría y conocimiento.
Y esto digo, para que nadie os engañe con palabras persuasivas.
Porque aunque estoy ausente con el cuerpo, no obstante con el espíritu estoy con vosotros, gozándome y mirando vuestro concierto, y la firmeza de vuestra fe en Cristo.
Por tanto, de la manera que habéis recibido al Señor Jesucristo, andad en él:
Arraigados y sobreedificados en él, y confirmados en la fe, así como habéis aprendido, creciendo en ella con hacimiento de gracias.
Mirad que ninguno os engañe por filosofías y vanas sutilezas, según las tradiciones de los hombres, conforme á los elementos del mundo, y no según Cristo:
Porque en él habita toda la plenitud de la divinidad corporalmente:
Y en él estáis cumplidos, el cual es la cabeza de todo principado y potestad:
En el cual también sois circuncidados de circuncisión no hecha con manos, con el despojamiento del cuerpo de los pecados de la carne, en la circuncisión de Cristo;
Sepultados juntamente con él en el bautismo, en el cual también resucitasteis con él, por la fe de la operación de Dios que le levantó de los muertos.
Y á vosotros, estando muertos en pecados y en la incircuncisión de vuestra carne, os vivificó juntamente con él, perdonándoos todos los pecados,
Rayendo la cédula de los ritos que nos era contraria, que era contra nosotros, quitándola de en medio y enclavándola en la cruz;
Y despojando los principados y las potestades, sacólos á la vergüenza en público, triunfando de ellos en sí mismo.
Por tanto, nadie os juzgue en comida, ó en bebida, ó en parte de día de fiesta, ó de nueva luna, ó de sábados:
Lo cual es la sombra de lo por venir; mas el cuerpo es de Cristo.
Nadie os prive de vuestro premio, afectando humildad y culto á los ángeles, metiéndose en lo que no ha visto, vanamente hinchado en el sentido de su propia carne,
Y no teniendo la cabeza, de la cual todo el cuerpo, alimentado y conjunto por las ligaduras y conjunturas, crece en aumento de Dios.
Pues si sois muertos con Cristo cuanto á los rudimentos del mundo, ¿por qué como si vivieseis al mundo, os sometéis á ordenanzas,
Tales como, No manejes, ni gustes, ni aun toques,
(Las cuales cosas son todas para destrucción en el uso mismo), en conformidad á mandamientos y doctrinas de hombres?
Tales cosas tienen á la verdad cierta reputación de sabiduría en culto voluntario, y humildad, y en duro trato del cuerpo; no en alguna honra para el saciar de la carne.
SI habéis pues resucitado con Cristo, buscad las cosas de arriba, donde está Cristo sentado á la diestra de Dios.
Poned la mira en las cosas de arriba, no en las de la tierra.
Porque muertos sois, y vuestra vida está escondida con Cristo en Dios.
Cuando Cristo, vuestra vida, se manifestare, entonces vosotros también seréis manifestados con él en gloria.
Amortiguad, pues, vuestros miembros que están sobre la tierra: fornicación, inmundicia, molicie, mala concupiscencia, y avaricia, que es idolatría:
Por las cuales cosas la ira de Dios viene sobre los hijos de rebelión.
En las cuales vosotros también anduvisteis en otro tiempo viviendo en ellas.
Mas ahora, dejad también vosotros todas estas cosas: ira, enojo, malicia, maledicencia, torpes palabras de vuestra boca.
No mintáis los unos á los otros, habiéndoos despojado del viejo hombre con sus hechos,
Y revestídoos del nuevo, el cual por el conocimiento es renovado conforme á la imagen del que lo crió;
Donde no hay Griego ni Judío, circuncisión ni incircuncisión, bárbaro ni Scytha, siervo ni libre; mas Cristo es el todo, y en todos.
Vestíos pues, como escogidos de Dios, santos y amados, de entrañas de misericordia, de benignidad, de humildad, de mansedumbre, de tolerancia;
Sufriéndoos los unos á los otros, y perdonándoos los unos á los otros si alguno tuviere queja del otro: de la manera que Cristo os perdonó, así también hacedlo vosotros.
Y sobre todas estas cosas vestíos de caridad, la cual es el vínculo de la perfección.
Y la paz de Dios gobierne en vuestros corazones, á la cual asimismo sois llamados en un cuerpo; y sed agradecidos.
Y todo lo que hacéis, sea de palabra, ó de hecho, hacedlo todo en el nombre del Señor Jesús, dando gracias á Dios Padre por él.
Casadas, estad sujetas á vuestros maridos, como conviene en el Señor.
Maridos, amad á vuestras mujeres, y no seáis desapacibles con ellas.
Hijos, obedeced á vuestros padres en todo; porque esto agrada al Señor.
Padres, no irritéis á vuestros hijos, porque no se hagan de poco ánimo.
Siervos, obedeced en todo á vuestros amos carnales, no sirviendo al ojo, como los que agradan á los hombres, sino con sencillez de corazón, temiendo á Dios:
Y todo lo que hagáis, hacedlo de ánimo, como al Señor, y no á los hombres;
Sabiendo que del Señor recibiréis la compensación de la herencia: porque al Señor Cristo servís.
Mas el que hace injuria, recibirá la injuria que hiciere; que no hay acepción de personas.
AMOS, haced lo que es justo y derecho con vuestros siervos, sabiendo que también vosotros tenéis amo en los cielos.
Perseverad en oración, velando en ella con hacimiento de gracias:
Orando también juntamente por nosotros, que el Señor nos abra la puerta de la palabra, para hablar el misterio de Cristo, por el cual aun estoy preso,
Para que lo manifieste como me conviene hablar.
Andad en sabiduría para con los extraños, redimiendo el tiempo.
Sea vuestra palabra siempre con gracia, sazonada con sal; para que sepáis cómo os conviene responder á cada uno.
Todos mis negocios os hará saber Tichîco, hermano amado y fiel ministro y consiervo en el Señor:
El cual os he enviado á esto mismo, para que entienda vuestros negocios, y consuele vuestros corazones;
Con Onésimo, amado y fiel hermano, el cual es de vosotros. Todo lo que acá pasa, os harán saber.
Aristarchô, mi compañero en la prisión, os saluda, y Marcos, el sobrino de Bernabé (acerca del cual habéis recibido mandamientos; si fuere á vosotros, recibidle),
Y Jesús, el que se llama Justo; los cuales son de la circuncisión: éstos solos son los que me ayudan en el reino de Dios, y me han sido consuelo.
Os saluda Epafras, el cual es de vosotros, siervo de Cristo, siempre solícito por vosotros en oraciones, para que estéis firmes, perfectos y cumplidos en todo lo que Dios quiere.
Porque le doy testimonio, que tiene gran celo por vosotros, y por los que están en Laodicea, y los que en Hierápolis.
Os saluda Lucas, el médico amado, y Demas.
Saludad á los hermanos que están en Laodicea, y á Nimfas, y á la iglesia que está en su casa.
Y cuando esta carta fuere leída entre vosotros, haced que también sea leída en la iglesia de los Laodicenses; y la de Laodicea que la leáis también vosotros.
Y decid á Archîpo: Mira que cumplas el ministerio que has recibido del Señor.
La salutación de mi mano, de Pablo. Acordaos de mis prisiones. La gracia sea con vosotros. Amén. Escrita de Roma á los Colosenses; enviada con Tichîco y Onésimo.
PABLO, y Silvano, y Timoteo, á la iglesia de los Tesalonicensesque esen Dios Padre y en el Señor Jesucristo: Gracia y paz á vosotros de Dios nuestro Padre y del Señor Jesucristo.
Damos siempre gracias á Dios por todos vosotros, haciendo memoria de vosotros en nuestras oraciones;
Sin cesar acordándonos delante del Dios y Padre nuestro de la obra de vuestra fe, y del trabajo de amor, y de la tolerancia de la esperanza del Señor nuestro Jesucristo:
Sabiendo, hermanos amados de Dios, vuestra elección:
Por cuanto nuestro evangelio no fué á vosotros en palabra solamente, mas también en potencia, y en Espíritu Santo, y en gran plenitud; como sabéis cuáles fuimos entre vosotros por amor de vosotros.
Y vosotros fuisteis hechos imitadores de nosotros, y del Señor, recibiendo la palabra con mucha tribulación, con gozo del Espíritu Santo:
En tal manera que habéis sido ejemplo á todos los que han creído en Macedonia y en Acaya.
Porque de vosotros ha sido divulgada la palabra del Señor no sólo en Macedonia y en Acaya, mas aun en todo lugar vuestra fe en Dios se ha extendido; de modo que no tenemos necesidad de hablar nada.
Porque ellos cuentan de nosotros cuál entrada tuvimos á vosotros; y cómo os convertisteis de los ídolos á Dios, para servir al Dios vivo y verdadero,
Y esperar á su Hijo de los cielos, al cual resucitó de los muertos; á Jesús, el cual nos libró de la ira que ha de venir.
PORQUE, hermanos, vosotros mismos sabéis que nuestra entrada á vosotros no fué vana:
Pues aun habiendo padecido antes, y sido afrentados en Filipos, como sabéis, tuvimos denuedo en Dios nuestro para anunciaros el evangelio de Dios con gran combate.
Porque nuestra exhortación no fué de error, ni de inmundicia, ni por engaño;
Sino según fuimos aprobados de Dios para que se nos encargase el evangelio, así hablamos; no como los que agradan á los hombres, sino á Dios, el cual prueba nuestros corazones.
Porque nunca fuimos lisonjeros en la palabra, como sabéis, ni tocados de avaricia; Dios es testigo;
Ni buscamos de los hombres gloria, ni de vosotros, ni de otros, aunque podíamos seros carga como apóstoles de Cristo.
Antes fuimos blandos entre vosotros como la que cría, que regala á sus hijos:
Tan amadores de vosotros, que quisiéramos entregaros no sólo el evangelio de Dios, mas aun nuestras propias almas; porque nos erais carísimos.
Porque ya, hermanos, os acordáis de nuestro trabajo y fatiga: que trabajando de noche y de día por no ser gravosos á ninguno de vosotros, os predicamos el evangelio de Dios.
Vosotros sois testigos, y Dios, de cuán santa y justa é irreprensiblemente nos condujimos con vosotros que creísteis:
Así como sabéis de qué modo exhortábamos y consolábamos á cada uno de vosotros, como el padre á sus hijos,
Y os protestábamos que anduvieseis como es digno de Dios, que os llamó á su reino y gloria.
Los cuales aun mataron al Señor Jesús y á sus propios profetas, y á nosotros nos han perseguido; y no agradan á Dios, y se oponen á todos los hombres;
Prohibiéndonos hablar á los Gentiles, á fin de que se salven, para henchir la medida de sus pecados siempre: pues vino sobre ellos la ira hasta el extremo.
Mas nosotros, hermanos, privados de vosotros por un poco de tiempo, de vista, no de corazón, tanto más procuramos con mucho deseo ver vuestro rostro.
Por lo cual quisimos ir á vosotros, yo Pablo á la verdad, una vez y otra; mas Satanás nos embarazó.
Porque ¿cuál es nuestra esperanza, ó gozo, ó corona de que me gloríe? ¿No sois vosotros, delante de nuestro Señor Jesucristo en su venida?
Que vosotros sois nuestra gloria y gozo.
POR lo cual, no pudiendo esperar más, acordamos quedarnos solos en Atenas,
Y enviamos á Timoteo, nuestro hermano, y ministro de Dios, y colaborador nuestro en el evangelio de Cristo, á confirmaros y exhortaros en vuestra fe,
Para que nadie se conmueva por estas tribulaciones; porque vosotros sabéis que nosotros somos puestos para esto.
Que aun estando con vosotros, os predecíamos que habíamos de pasar tribulaciones, como ha acontecido y sabéis.
Por lo cual, también yo, no esperando más, he enviado á reconocer vuestra fe, no sea que os haya tentado el tentador, y que nuestro trabajo haya sido en vano.
Empero volviendo de vosotros á nosotros Timoteo, y haciéndonos saber vuestra fe y caridad, y que siempre tenéis buena memoria de nosotros, deseando vernos, como también nosotros á vosotros,
En ello, hermanos, recibimos consolación de vosotros en toda nuestra necesidad y aflicción por causa de vuestra fe:
Porque ahora vivimos, si vosotros estáis firmes en el Señor.
Por lo cual, ¿qué hacimiento de gracias podremos dar á Dios por vosotros, por todo el gozo con que nos gozamos á causa de vosotros delante de nuestro Dios,
Orando de noche y de día con grande instancia, que veamos vuestro rostro, y que cumplamos lo que falta á vuestra fe?
Mas el mismo Dios y Padre nuestro, y el Señor nuestro Jesucristo, encamine nuestro viaje á vosotros.
Y á vosotros multiplique el Señor, y haga abundar el amor entre vosotros, y para con todos, como es también de nosotros para con vosotros;
Para que sean confirmados vuestros corazones en santidad, irreprensibles delante de Dios y nuestro Padre, para la venida de nuestro Señor Jesucristo con todos sus santos.
RESTA pues, hermanos, que os roguemos y exhortemos en el Señor Jesús, que de la manera que fuisteis enseñados de nosotros de cómo os conviene andar, y agradar á Dios, asívayáis creciendo.
Porque ya sabéis qué mandamientos os dimos por el Señor Jesús.
Porque la voluntad de Dios es vuestra santificación: que os apartéis de fornicación;
Que cada uno de vosotros sepa tener su vaso en santificación y honor;
No con afecto de concupiscencia, como los Gentiles que no conocen á Dios:
Que ninguno oprima, ni engañe en nada á su hermano: porque el Señor es vengador de todo esto, como ya os hemos dicho y protestado.
Porque no nos ha llamado Dios á inmundicia, sino á santificación.
Así que, el que menosprecia, no menosprecia á hombre, sino á Dios, el cual también nos dió su Espíritu Santo.
Mas acerca de la caridad fraterna no habéis menester que os escriba: porque vosotros mismos habéis aprendido de Dios que os améis los unos á los otros;
Y también lo hacéis así con todos los hermanos que están por toda Macedonia. Empero os rogamos, hermanos, que abundéis más;
Y que procuréis tener quietud, y hacer vuestros negocios, y obréis de vuestras manos de la manera que os hemos mandado;
A fin de que andéis honestamente para con los extraños, y no necesitéis de nada.
Tampoco, hermanos, queremos que ignoréis acerca de los que duermen, que no os entristezcáis como los otros que no tienen esperanza.
Porque si creemos que Jesús murió y resucitó, así también traerá Dios con él á los que durmieron en Jesús.
Por lo cual, os decimos esto en palabra del Señor: que nosotros que vivimos, que habremos quedado hasta la venida del Señor, no seremos delanteros á los que durmieron.
Porque el mismo Señor con aclamación, con voz de arcángel, y con trompeta de Dios, descenderá del cielo; y los muertos en Cristo resucitarán primero:
Luego nosotros, los que vivimos, los que quedamos, juntamente con ellos seremos arrebatados en las nubes á recibir al Señor en el aire, y así estaremos siempre con el Señor.
Por tanto, consolaos los unos á los otros en estas palabras.
EMPERO acerca de los tiempos y de los momentos, no tenéis, hermanos, necesidad de que yo os escriba:
Porque vosotros sabéis bien, que el día del Señor vendrá así como ladrón de noche,
Que cuando dirán, Paz y seguridad, entonces vendrá sobre ellos destrucción de repente, como los dolores á la mujer preñada; y no escaparán.
Mas vosotros, hermanos, no estáis en tinieblas, para que aquel día os sobrecoja como ladrón;
Porque todos vosotros sois hijos de luz, é hijos del día; no somos de la noche, ni de las tinieblas.
Por tanto, no durmamos como los demás; antes velemos y seamos sobrios.
Porque los que duermen, de noche duermen; y los que están borrachos, de noche están borrachos.
Mas nosotros, que somos del día, estemos sobrios, vestidos de cota de fe y de caridad, y la esperanza de salud por yelmo.
Porque no nos ha puesto Dios para ira, sino para alcanzar salud por nuestro Señor Jesucristo;
El cual murió por nosotros, para que ó que velemos, ó que durmamos, vivamos juntamente con él.
Por lo cual, consolaos los unos á los otros, y edificaos los unos á los otros, así como lo hacéis.
Y os rogamos, hermanos, que reconozcáis á los que trabajan entre vosotros, y os presiden en el Señor, y os amonestan:
Y que los tengáis en mucha estima por amor de su obra. Tened paz los unos con los otros.
También os rogamos, hermanos, que amonestéis á los que andan desordenadamente, que consoléis á los de poco ánimo, que soportéis á los flacos, que seáis sufridos para con todos.
Mirad que ninguno dé á otro mal por mal; antes seguid lo bueno siempre los unos para con los otros, y para con todos.
Estad siempre gozosos.
Orad sin cesar.
Dad gracias en todo; porque esta es la voluntad de Dios para con vosotros en Cristo Jesús.
No apaguéis el Espíritu.
No menospreciéis las profecías.
Examinadlo todo; retened lo bueno.
Apartaos de toda especie de mal.
Y el Dios de paz os santifique en todo; para que vuestro espíritu y alma y cuerpo sea guardado entero sin reprensión para la venida de nuestro Señor Jesucristo.
Fiel es el que os ha llamado; el cual también lo hará.
Hermanos, orad por nosotros.
Saludad á todos los hermanos en ósculo santo.
Conjúroos por el Señor, que esta carta sea leída á todos los santos hermanos.
PABLO, y Silvano, y Timoteo, á la iglesia de los Tesalonicensesque esen Dios nuestro Padre y en el Señor Jesucristo:
Gracia y paz á vosotros de Dios nuestro Padre y del Señor Jesucristo.
Debemos siempre dar gracias á Dios de vosotros, hermanos, como es digno, por cuanto vuestra fe va creciendo, y la caridad de cada uno de todos vosotros abunda entre vosotros;
Tanto, que nosotros mismos nos gloriamos de vosotros en las iglesias de Dios, de vuestra paciencia y fe en todas vuestras persecuciones y tribulaciones que sufrís:
Una demostración del justo juicio de Dios, para que seáis tenidos por dignos del reino de Dios, por el cual asimismo padecéis.
Porque es justo para con Dios pagar con tribulación á los que os atribulan.
Y á vosotros, que sois atribulados, darreposo con nosotros, cuando se manifestará el Señor Jesús del cielo con los ángeles de su potencia,
En llama de fuego, para dar el pago á los que no conocieron á Dios, ni obedecen al evangelio de nuestro Señor Jesucristo;
Los cuales serán castigados de eterna perdición por la presencia del Señor, y por la gloria de su potencia,
Cuando viniere para ser glorificado en sus santos, y á hacerse admirable en aquel día en todos los que creyeron: (por cuanto nuestro testimonio ha sido creído entre vosotros.)
Por lo cual, asimismo oramos siempre por vosotros, que nuestro Dios os tenga por dignos de su vocación, é hincha de bondad todo buen intento, y toda obra de fe con potencia,
Para que el nombre de nuestro Señor Jesucristo sea glorificado en vosotros, y vosotros en él, por la gracia de nuestro Dios y del Señor Jesucristo.
EMPERO os rogamos, hermanos, cuanto á la venida de nuestro Señor Jesucristo, y nuestro recogimiento á él,
Que no os mováis fácilmente de vuestro sentimiento, ni os conturbéis ni por espíritu, ni por palabra, ni por carta como nuestra, como que el día del Señor esté cerca.
No os engañe nadie en ninguna manera; porqueno vendrásin que venga antes la apostasía, y se manifieste el hombre de pecado, el hijo de perdición,
Oponiéndose, y levantándose contra todo lo que se llama Dios, ó que se adora; tanto que se asiente en el templo de Dios como Dios, haciéndose parecer Dios.
¿No os acordáis que cuando estaba todavía con vosotros, os decía esto?
Y ahora vosotros sabéis lo que impide, para que á su tiempo se manifieste.
Porque ya está obrando el misterio de iniquidad: solamente espera hasta que sea quitado de en medio el que ahora impide;
Y entonces será manifestado aquel inicuo, al cual el Señor matará con el espíritu de su boca, y destruirá con el resplandor de su venida;
A aquel inicuo, cuyo advenimiento es según operación de Satanás, con grande potencia, y señales, y milagros mentirosos,
Y con todo engaño de iniquidad en los que perecen; por cuanto no recibieron el amor de la verdad para ser salvos.
Por tanto, pues, les envía Dios operación de error, para que crean á la mentira;
Para que sean condenados todos los que no creyeron á la verdad, antes consintieron á la iniquidad.
A lo cual os llamó por nuestro evangelio, para alcanzar la gloria de nuestro Señor Jesucristo.
Así que, hermanos, estad firmes, y retened la doctrina que habéis aprendido, sea por palabra, ó por carta nuestra.
Y el mismo Señor nuestro Jesucristo, y Dios y Padre nuestro, el cual nos amó, y nos dió consolación eterna, y buena esperanza por gracia,
Consuele vuestros corazones, y os confirme en toda buena palabra y obra.
RESTA, hermanos, que oréis por nosotros, que la palabra del Señor corra y sea glorificada así como entre vosotros:
Y que seamos librados de hombres importunos y malos; porque no es de todos la fe.
Mas fiel es el Señor, que os confirmará y guardará del mal.
Y tenemos confianza de vosotros en el Señor, que hacéis y haréis lo que os hemos mandado.
Y el Señor enderece vuestros corazones en el amor de Dios, y en la paciencia de Cristo.
Empero os denunciamos, hermanos, en el nombre de nuestro Señor Jesucristo, que os apartéis de todo hermano que anduviere fuera de orden, y no conforme á la doctrina que recibieron de nosotros:
Porque vosotros mismos sabéis de qué manera debéis imitarnos: porque no anduvimos desordenadamente entre vosotros,
Ni comimos el pan de ninguno de balde; antes, obrando con trabajo y fatiga de noche y de día, por no ser gravosos á ninguno de vosotros;
No porque no tuviésemos potestad, sino por daros en nosotros un dechado, para que nos imitaseis.
Porque aun estando con vosotros, os denunciábamos esto: Que si alguno no quisiere trabajar, tampoco coma.
Porque oímos que andan algunos entre vosotros fuera de orden, no trabajando en nada, sino ocupados en curiosear.
Y á los tales requerimos y rogamos por nuestro Señor Jesucristo, que, trabajando con reposo, coman su pan.
Y vosotros, hermanos, no os canséis de hacer bien.
Y si alguno no obedeciere á nuestra palabra por carta, notad al tal, y no os juntéis con él, para que se avergüence.
Mas no lo tengáis como á enemigo, sino amonestadle como á hermano.
Y el mismo Señor de paz os dé siempre paz en toda manera. El Señor sea con todos vosotros.
Salud de mi mano, Pablo, que es mi signo en toda carta mía: así escribo.
PABLO, apóstol de Jesucristo por la ordenación de Dios nuestro Salvador, y del Señor Jesucristo, nuestra esperanza;
A Timoteo, verdadero hijo en la fe: Gracia, misericordia y paz de Dios nuestro Padre, y de Cristo Jesús nuestro Señor.
Como te rogué que te quedases en Efeso, cuando partí para Macedonia, para que requirieses á algunos que no enseñen diversa doctrina,
Ni presten atención á fábulas y genealogías sin término, que antes engendran cuestiones que la edificación de Dios que es por fe; así te encargo ahora.
Pues el fin del mandamiento es la caridadnacidade corazón limpio, y de buena conciencia, y de fe no fingida:
De lo cual distrayéndose algunos, se apartaron á vanas pláticas;
Queriendo ser doctores de la ley, sin entender ni lo que hablan, ni lo que afirman.
Sabemos empero que la ley es buena, si alguno usa de ella legítimamente;
Para los fornicarios, para los sodomitas, para los ladrones de hombres, para los mentirosos y perjuros, y si hay alguna otra cosa contraria á la sana doctrina;
Según el evangelio de la gloria del Dios bendito, el cual á mí me ha sido encargado.
Y doy gracias al que me fortificó, á Cristo Jesús nuestro Señor, de que me tuvo por fiel, poniéndome en el ministerio:
Habiendo sido antes blasfemo y perseguidor é injuriador: mas fuí recibido á misericordia, porque lo hice con ignorancia en incredulidad.
Mas la gracia de nuestro Señor fué más abundante con la fe y amor queesen Cristo Jesús.
Palabra fiel y digna de ser recibida de todos: que Cristo Jesús vino al mundo para salvar á los pecadores, de los cuales yo soy el primero.
Mas por esto fuí recibido á misericordia, para que Jesucristo mostrase en mí el primero toda su clemencia, para ejemplo de los que habían de creer en él para vida eterna.
Por tanto, al Rey de siglos, inmortal, invisible, al solo sabio Diosseahonor y gloria por los siglos de los siglos. Amén.
Este mandamiento, hijo Timoteo, te encargo, para que, conforme á las profecías pasadas de ti, milites por ellas buena milicia;
Manteniendo la fe y buena conciencia, la cual echando de sí algunos, hicieron naufragio en la fe:
De los cuales son Himeneo y Alejandro, los cuales entregué á Satanás, para que aprendan á no blasfemar.
AMONESTO pues, ante todas cosas, que se hagan rogativas, oraciones, peticiones, hacimientos de gracias, por todos los hombres;
Por los reyes y por todos los que están en eminencia, para que vivamos quieta y reposadamente en toda piedad y honestidad.
Porque esto es bueno y agradable delante de Dios nuestro Salvador;
El cual quiere que todos los hombres sean salvos, y que vengan al conocimiento de la verdad.
Porque hay un Dios, asimismo un mediador entre Dios y los hombres, Jesucristo hombre;
El cual se dió á sí mismo en precio del rescate por todos, para testimonio en sus tiempos:
De lo que yo soy puesto por predicador y apóstol, (digo verdad en Cristo, no miento) doctor de los Gentiles en fidelidad y verdad.
Quiero, pues, que los hombres oren en todo lugar, levantando manos limpias, sin ira ni contienda.
Asimismo también las mujeres, ataviándose en hábito honesto, con vergüenza y modestia; no con cabellos encrespados, ú oro, ó perlas, ó vestidos costosos,
Sino de buenas obras, como conviene á mujeres que profesan piedad.
La mujer aprenda en silencio, con toda sujeción.
Porque no permito á la mujer enseñar, ni tomar autoridad sobre el hombre, sino estar en silencio.
Porque Adam fué formado el primero, después Eva;
Y Adam no fué engañado, sino la mujer, siendo seducida, vino á ser envuelta en transgresión:
Empero se salvará engendrando hijos, si permaneciere en la fe y caridad y santidad, con modestia.
PALABRA fiel: Si alguno apetece obispado, buena obra desea.
Conviene, pues, que el obispo sea irreprensible, marido de una mujer, solícito, templado, compuesto, hospedador, apto para enseñar;
No amador del vino, no heridor, no codicioso de torpes ganancias, sino moderado, no litigioso, ajeno de avaricia;
Que gobierne bien su casa, que tenga sus hijos en sujeción con toda honestidad;
(Porque el que no sabe gobernar su casa, ¿cómo cuidará de la iglesia de Dios?)
No un neófito, porque inflándose no caiga en juicio del diablo.
También conviene que tenga buen testimonio de los extraños, porque no caiga en afrenta y en lazo del diablo.
Los diáconos asimismo, deben ser honestos, no bilingües, no dados á mucho vino, no amadores de torpes ganancias;
Que tengan el misterio de la fe con limpia conciencia.
Y éstos también sean antes probados; y así ministren, si fueren sin crimen.
Las mujeres asimismo, honestas, no detractoras, templadas, fieles en todo.
Los diáconos sean maridos de una mujer, que gobiernen bien sus hijos y sus casas.
Porque los que bien ministraren, ganan para sí buen grado, y mucha confianza en la fe que es en Cristo Jesús.
Esto te escribo con esperanza que iré presto á ti:
Y si no fuere tan presto, para que sepas cómo te conviene conversar en la casa de Dios, que es la iglesia del Dios vivo, columna y apoyo de la verdad.
EMPERO el Espíritu dice manifiestamente, que en los venideros tiempos algunos apostatarán de la fe, escuchando á espíritus de error y á doctrinas de demonios;
Que con hipocresía hablarán mentira, teniendo cauterizada la conciencia.
Que prohibirán casarse, y mandaránabstenerse de las viandas que Dios crió para que con hacimiento de gracias participasen de ellas los fieles, y los que han conocido la verdad.
Porque todo lo que Dios crió es bueno, y nada hay que desechar, tomándose con hacimiento de gracias:
Porque por la palabra de Dios y por la oración es santificado.
Si esto propusieres á los hermanos, serás buen ministro de Jesucristo, criado en las palabras de la fe y de la buena doctrina, la cual has alcanzado.
Mas las fábulas profanas y de viejas desecha, y ejercítate para la piedad.
Porque el ejercicio corporal para poco es provechoso; mas la piedad para todo aprovecha, pues tiene promesa de esta vida presente, y de la venidera.
Palabra fiel es esta, y digna de ser recibida de todos.
Que por esto aun trabajamos y sufrimos oprobios, porque esperamos en el Dios viviente, el cual es Salvador de todos los hombres, mayormente de los que creen.
Esto manda y enseña.
Ninguno tenga en poco tu juventud; pero sé ejemplo de los fieles en palabra, en conversación, en caridad, en espíritu, en fe, en limpieza.
Entre tanto que voy, ocúpate en leer, en exhortar, en enseñar.
No descuides el don que está en ti, que te es dado por profecía con la imposición de las manos del presbiterio.
Medita estas cosas; ocúpate en ellas; para que tu aprovechamiento sea manifiesto á todos.
Ten cuidado de ti mismo y de la doctrina; persiste en ello; pues haciendo esto, á ti mismo salvarás y á los que te oyeren.
NO reprendas al anciano, sino exhórtale como á padre: á los más jóvenes, como á hermanos;
A las ancianas, como á madres; á las jovencitas, como á hermanas, con toda pureza.
Honra á las viudas que en verdad son viudas.
Pero si alguna viuda tuviere hijos, ó nietos, aprendan primero á gobernar su casa piadosamente, y á recompensar á sus padres: porque esto es lo honesto y agradable delante de Dios.
Ahora, la que en verdad es viuda y solitaria, espera en Dios, y es diligente en suplicaciones y oraciones noche y día.
Pero la que vive en delicias, viviendo está muerta.
Denuncia pues estas cosas, para que sean sin reprensión.
Y si alguno no tiene cuidado de los suyos, y mayormente de los de su casa, la fe negó, y es peor que un infiel.
La viuda sea puesta en claseespecial, no menos que de sesenta años, que haya sido esposa de unsolomarido.
Pero viudas más jóvenes no admitas: porque después de hacerse licenciosas contra Cristo, quieren casarse.
Condenadas ya, por haber falseado la primera fe.
Y aun también se acostumbran á ser ociosas, á andar de casa en casa; y no solamente ociosas, sino también parleras y curiosas, hablando lo que no conviene.
Quiero pues, que las que son jóvenes se casen, críen hijos, gobiernen la casa; que ninguna ocasión den al adversario para maldecir.
Porque ya algunas han vuelto atrás en pos de Satanás.
Si algún fiel ó alguna fiel tiene viudas, manténgalas, y no sea gravada la iglesia; á fin de que haya lo suficiente para las que de verdad son viudas.
Los ancianos que gobiernan bien, sean tenidos por dignos de doblada honra; mayormente los que trabajan en predicar y enseñar.
Porque la Escritura dice: No embozarás al buey que trilla; y: Digno es el obrero de su jornal.
Contra el anciano no recibas acusación sino con dos ó tres testigos.
A los que pecaren, repréndelos delante de todos, para que los otros también teman.
Te requiero delante de Dios y del Señor Jesucristo, y de sus ángeles escogidos, que guardes estas cosas sin perjuicio de nadie, que nada hagas inclinándote á la una parte.
No impongas de ligero las manos á ninguno, ni comuniques en pecados ajenos: consérvate en limpieza.
No bebas de aquí adelante agua, sino usa de un poco de vino por causa del estómago, y de tus continuas enfermedades.
Los pecados de algunos hombres, antes que vengan ellos á juicio, son manifiestos; mas á otros les vienen después.
Asimismo las buenas obras antes son manifiestas; y las que son de otra manera, no pueden esconderse.
TODOS los que están debajo del yugo de servidumbre, tengan á sus señores por dignos de toda honra, porque no sea blasfemado el nombre del Señor y la doctrina.
Si alguno enseña otra cosa, y no asiente á sanas palabras de nuestro Señor Jesucristo, y á la doctrina que es conforme á la piedad;
Es hinchado, nada sabe, y enloquece acerca de cuestiones y contiendas de palabras, de las cuales nacen envidias, pleitos, maledicencias, malas sospechas,
Porfías de hombres corruptos de entendimiento y privados de la verdad, que tienen la piedad por granjería: apártate de los tales.
Empero grande granjería es la piedad con contentamiento.
Porque nada hemos traído á este mundo, y sin duda nada podremos sacar.
Así que, teniendo sustento y con qué cubrirnos, seamos contentos con esto.
Porque los que quieren enriquecerse, caen en tentación y lazo, y en muchas codicias locas y dañosas, que hunden á los hombres en perdición y muerte.
Porque el amor del dinero es la raíz de todos los males: el cual codiciando algunos, se descaminaron de la fe, y fueron traspasados de muchos dolores.
Mas tú, oh hombre de Dios, huye de estas cosas, y sigue la justicia, la piedad, la fe, la caridad, la paciencia, la mansedumbre.
Pelea la buena batalla de la fe, echa mano de la vida eterna, á la cual asimismo eres llamado, habiendo hecho buena profesión delante de muchos testigos.
Te mando delante de Dios, que da vida á todas las cosas, y de Jesucristo, que testificó la buena profesión delante de Poncio Pilato,
Que guardes el mandamiento sin mácula ni reprensión, hasta la aparición de nuestro Señor Jesucristo:
La cual á su tiempo mostrará el Bienaventurado y solo Poderoso, Rey de reyes, y Señor de señores;
Quien sólo tiene inmortalidad, que habita en luz inaccesible; á quien ninguno de los hombres ha visto ni puede ver: al cual sea la honra y el imperio sempiterno. Amén.
A los ricos de este siglo manda que no sean altivos, ni pongan la esperanza en la incertidumbre de las riquezas, sino en el Dios vivo, que nos da todas las cosas en abundancia de que gocemos:
Que hagan bien, que sean ricos en buenas obras, dadivosos, que con facilidad comuniquen;
Atesorando para sí buen fundamento para lo por venir, que echen mano á la vida eterna.
Oh Timoteo, guarda lo que se te ha encomendado, evitando las profanas pláticas de vanas cosas, y los argumentos de la falsamente llamada ciencia:
PABLO, apóstol de Jesucristo por la voluntad de Dios, según la promesa de la vida que es en Cristo Jesús,
A Timoteo, amado hijo: Gracia, misericordia, ypaz de Dios el Padre y de Jesucristo nuestro Señor.
Doy gracias á Dios, al cual sirvo desde mis mayores con limpia conciencia, de que sin cesar tengo memoria de ti en mis oraciones noche y día;
Deseando verte, acordándome de tus lágrimas, para ser lleno de gozo;
Trayendo á la memoria la fe no fingida que hay en ti, la cual residió primero en tu abuela Loida, y en tu madre Eunice; y estoy cierto que en ti también.
Por lo cual te aconsejo que despiertes el don de Dios, que está en ti por la imposición de mis manos.
Porque no nos ha dado Dios el espíritu de temor, sinoelde fortaleza, y de amor, y de templanza.
Por tanto no te avergüences del testimonio de nuestro Señor, ni de mí, preso suyo; antes sé participante de los trabajos del evangelio según la virtud de Dios,
Que nos salvó y llamó con vocación santa, no conforme á nuestras obras, mas según el intento suyo y gracia, la cual nos es dada en Cristo Jesús antes de los tiempos de los siglos,
Mas ahora es manifestada por la aparición de nuestro Salvador Jesucristo, el cual quitó la muerte, y sacó á la luz la vida y la inmortalidad por el evangelio;
Del cual yo soy puesto predicador, y apóstol, y maestro de los Gentiles.
Por lo cual asimismo padezco esto: mas no me avergüenzo; porque yo sé á quien he creído, y estoy cierto que es poderoso para guardar mi depósito para aquel día.
Retén la forma de las sanas palabras que de mí oíste, en la fe y amor que es en Cristo Jesús.
Guarda el buen depósito por el Espíritu Santo que habita en nosotros.
Yasabes esto, que me han sido contrarios todos los que son en Asia, de los cuales son Figello y Hermógenes.
Dé el Señor misericordia á la casa de Onesíforo; que muchas veces me refrigeró, y no se avergonzó de mi cadena:
Antes, estando él en Roma, me buscó solícitamente, y me halló.
Déle el Señor que halle misericordia cerca del Señor en aquel día. Y cuántonosayudó en Efeso, tú lo sabes mejor.
PUES tú, hijo mío, esfuérzate en la gracia que es en Cristo Jesús.
Y lo que has oído de mí entre muchos testigos, esto encarga á los hombres fieles que serán idóneos para enseñar también á otros.
Tú pues, sufre trabajos como fiel soldado de Jesucristo.
Ninguno que milita se embaraza en los negocios de la vida; á fin de agradar á aquel que lo tomó por soldado.
Y aun también el que lidia, no es coronado si no lidiare legítimamente.
El labrador, para recibir los frutos, es menester que trabaje primero.
Considera lo que digo; y el Señor te dé entendimiento en todo.
Acuérdate que Jesucristo, el cual fuéde la simiente de David, resucitó de los muertos conforme á mi evangelio;
En el que sufro trabajo, hasta las prisiones á modo de malhechor; mas la palabra de Dios no está presa.
Por tanto, todo lo sufro por amor de los escogidos, para que ellos también consigan la salud que es en Cristo Jesús con gloria eterna.
Es palabra fiel: Que si somos muertos con él, también viviremos con él:
Si sufrimos, también reinaremos con él: si negáremos, él también nos negará:
Si fuéremos infieles, él permanece fiel: no se puede negar á sí mismo.
Recuérdales esto, protestando delante del Señor que no contiendan en palabras, lo cual para nada aprovecha, antes trastorna á los oyentes.
Procura con diligencia presentarte á Dios aprobado, como obrero que no tiene de qué avergonzarse, que traza bien la palabra de verdad.
Mas evita profanas y vanas parlerías; porque muy adelante irán en la impiedad.
Y la palabra de ellos carcomerá como gangrena: de los cuales es Himeneo y Fileto;
Que se han descaminado de la verdad, diciendo que la resurrección es ya hecha, y trastornan la fe de algunos.
Pero el fundamento de Dios está firme, teniendo este sello: Conoce el Señor á los que son suyos; y: Apártese de iniquidad todo aquel que invoca el nombre de Cristo.
Mas en una casa grande, no solamente hay vasos de oro y de plata, sino también de madera y de barro: y asimismo unos para honra, y otros para deshonra.
Así que, si alguno se limpiare de estas cosas, será vaso para honra, santificado, y útil para los usos del Señor, y aparejado para todo buena obra.
Huye también los deseos juveniles; y sigue la justicia, la fe, la caridad, la paz, con los que invocan al Señor de puro corazón.
Empero las cuestiones necias y sin sabiduría desecha, sabiendo que engendran contiendas.
Que el siervo del Señor no debe ser litigioso, sino manso para con todos, apto para enseñar, sufrido;
Que con mansedumbre corrija á los que se oponen: si quizá Dios les dé que se arrepientan para conocer la verdad,
Y se zafen del lazo del diablo, en que están cautivos á voluntad de él.
ESTO también sepas, que en los postreros días vendrán tiempos peligrosos:
Que habrá hombres amadores de sí mismos, avaros, vanagloriosos, soberbios, detractores, desobedientes á los padres, ingratos, sin santidad,
Sin afecto, desleales, calumniadores, destemplados, crueles, aborrecedores de lo bueno,
Traidores, arrebatados, hinchados, amadores de los deleites más que de Dios;
Teniendo apariencia de piedad, mas habiendo negado la eficacia de ella: y á éstos evita.
Porque de éstos son los que se entran por las casas, y llevan cautivas las mujercillas cargadas de pecados, llevadas de diversas concupiscencias;
Que siempre aprenden, y nunca pueden acabar de llegar al conocimiento de la verdad.
Y de la manera que Jannes y Jambres resistieron á Moisés, así también éstos resisten á la verdad; hombres corruptos de entendimiento, réprobos acerca de la fe.
Mas no prevalecerán; porque su insensatez será manifiesta á todos, como también lo fué la de aquéllos.
Pero tú has comprendido mi doctrina, instrucción, intento, fe, largura de ánimo, caridad, paciencia,
Persecuciones, aflicciones, cuales me sobrevinieron en Antioquía, en Iconio, en Listra, cuales persecuciones he sufrido; y de todas me ha librado el Señor.
Y también todos los que quieren vivir píamente en Cristo Jesús, padecerán persecución.
Mas los malos hombres y los engañadores, irán de mal en peor, engañando y siendo engañados.
Empero persiste tú en lo que has aprendido y te persuadiste, sabiendo de quién has aprendido;
Y que desde la niñez has sabido las Sagradas Escrituras, las cuales te pueden hacer sabio para la salud por la fe que es en Cristo Jesús.
Toda Escritura es inspirada divinamente y útil para enseñar, para redargüir, para corregir, para instituir en justicia,
Para que el hombre de Dios sea perfecto, enteramente instruído para toda buena obra.
REQUIERO yo pues delante de Dios, y del Señor Jesucristo, que ha de juzgar á los vivos y los muertos en su manifestación y en su reino,
Que prediques la palabra; que instes á tiempo y fuera de tiempo; redarguye, reprende, exhorta con toda paciencia y doctrina.
Porque vendrá tiempo cuando no sufrirán la sana doctrina; antes, teniendo comezón de oir, se amontonarán maestros conforme á sus concupiscencias,
Y apartarán de la verdad el oído, y se volverán á las fábulas.
Pero tú vela en todo, soporta las aflicciones, haz la obra de evangelista, cumple tu ministerio.
Porque yo ya estoy para ser ofrecido, y el tiempo de mi partida está cercano.
He peleado la buena batalla, he acabado la carrera, he guardado la fe.
Por lo demás, me está guardada la corona de justicia, la cual me dará el Señor, juez justo, en aquel día; y no sólo á mí, sino también á todos los que aman su venida.
Procura venir presto á mí:
Porque Demas me ha desamparado, amando este siglo, y se ha ido á Tesalónica; Crescente á Galacia, Tito á Dalmacia.
Lucas solo está conmigo. Toma á Marcos, y tráele contigo; porque me es útil para el ministerio.
A Tychîco envié á Efeso.
Trae, cuando vinieres, el capote que dejé en Troas en casa de Carpo: y los libros, mayormente los pergaminos.
Alejandro el calderero me ha causado muchos males: el Señor le pague conforme á sus hechos.
Guárdate tú también de él; que en grande manera ha resistido á nuestras palabras.
En mi primera defensa ninguno me ayudó, antes me desampararon todos: no les sea imputado.
Mas el Señor me ayudó, y me esforzó para que por mí fuese cumplida la predicación, y todos los Gentiles oyesen; y fuí librado de la boca del león.
Y el Señor me librará de toda obra mala, y me preservará para su reino celestial: al cual sea gloria por los siglos de los siglos. Amén.
Saluda á Prisca y á Aquila, y á la casa de Onesíforo.
Erasto se quedó en Corinto; y á Trófimo dejé en Mileto enfermo.
Procura venir antes del invierno. Eubulo te saluda, y Pudente, y Lino, y Claudia, y todos los hermanos.
PABLO, siervo de Dios, y apóstol de Jesucristo, según la fe de los escogidos de Dios, y el conocimiento de la verdad que es según la piedad,
Para la esperanza de la vida eterna, la cual Dios, que no puede mentir, prometió antes de los tiempos de los siglos,
Y manifestó á sus tiempos su palabra por la predicación, que me es á mí encomendada por mandamiento de nuestro Salvador Dios;
A Tito, verdadero hijo en la común fe: Gracia, misericordia, y paz de Dios Padre, y del Señor Jesucristo Salvador nuestro.
Por esta causa te dejé en Creta, para que corrigieses lo que falta, y pusieses ancianos por las villas, así como yo te mandé:
El que fuere sin crimen, marido de una mujer, que tenga hijos fieles que no estén acusados de disolución, ó contumaces.
Porque es menester que el obispo sea sin crimen, como dispensador de Dios; no soberbio, no iracundo, no amador del vino, no heridor, no codicioso de torpes ganancias;
Sino hospedador, amador de lo bueno, templado, justo, santo, continente;
Retenedor de la fiel palabra que es conforme á la doctrina: para que también pueda exhortar con sana doctrina, y convencer á los que contradijeren.
Porque hay aún muchos contumaces, habladores de vanidades, y engañadores de las almas, mayormente los que son de la circuncisión,
A los cuales es preciso tapar la boca; que trastornan casas enteras; enseñando lo que no conviene, por torpe ganancia.
Dijo uno de ellos, propio profeta de ellos: Los Cretenses, siempre mentirosos, malas bestias, vientres perezosos.
Este testimonio es verdadero: por tanto, repréndelos duramente, para que sean sanos en la fe,
No atendiendo á fábulas judaicas, y á mandamientos de hombres que se apartan de la verdad.
Todas las cosas son limpias á los limpios; mas á los contaminados é infieles nada es limpio: antes su alma y conciencia están contaminadas.
Profésanse conocer á Dios; mas con los hechos lo niegan, siendo abominables y rebeldes, reprobados para toda buena obra.
EMPERO tú, habla lo que conviene á la sana doctrina:
Que los viejos sean templados, graves, prudentes, sanos en la fe, en la caridad, en la paciencia.
Las viejas, asimismo, se distinganen un porte santo; no calumniadoras, no dadas á mucho vino, maestras de honestidad:
Que enseñen á las mujeres jóvenes á ser prudentes, á que amen á sus maridos, á que amen á sus hijos,
A ser templadas, castas, que tengan cuidado de la casa, buenas, sujetas á sus maridos; porque la palabra de Dios no sea blasfemada.
Exhorta asimismo á los mancebos á que sean comedidos;
Mostrándote en todo por ejemplo de buenas obras; en doctrina haciendo ver integridad, gravedad,
Palabra sana, é irreprensible; que el adversario se avergüence, no teniendo mal ninguno que decir de vosotros.
Exhorta á los siervos á que sean sujetos á sus señores, que agraden en todo, no respondones;
No defraudando, antes mostrando toda buena lealtad, para que adornen en todo la doctrina de nuestro Salvador Dios.
Porque la gracia de Dios que trae salvación á todos los hombres, se manifestó,
Enseñándonos que, renunciando á la impiedad y á los deseos mundanos, vivamos en este siglo templada, y justa, y píamente,
Esperando aquella esperanza bienaventurada, y la manifestación gloriosa del gran Dios y Salvador nuestro Jesucristo,
Que se dió á sí mismo por nosotros para redimirnos de toda iniquidad, y limpiar para sí un pueblo propio, celoso de buenas obras.
Esto habla y exhorta, y reprende con toda autoridad. Nadie te desprecie.
AMONÉSTALES que se sujeten á los príncipes y potestades, que obedezcan, que estén prontos á toda buena obra.
Que á nadie infamen, que no sean pendencieros, sinomodestos, mostrando toda mansedumbre para con todos los hombres.
Mas cuando se manifestó la bondad de Dios nuestro Salvador, y su amor para con los hombres,
No por obras de justicia que nosotros habíamos hecho, mas por su misericordia nos salvó, por el lavacro de la regeneración, y de la renovación del Espíritu Santo;
El cual derramó en nosotros abundantemente por Jesucristo nuestro Salvador,
Para que, justificados por su gracia, seamos hechos herederos según la esperanza de la vida eterna.
Mas las cuestiones necias, y genealogías, y contenciones, y debates acerca de la ley, evita; porque son sin provecho y vanas.
Rehusa hombre hereje, después de una y otra amonestación;
Estando cierto que el tal es trastornado, y peca, siendo condenado de su propio juicio.
Cuando enviare á ti á Artemas, ó á Tichîco, procura venir á mí, á Nicópolis: porque allí he determinado invernar.
A Zenas doctor de la ley, y á Apolos, envía delante, procurando que nada les falte.
Y aprendan asimismo los nuestros á gobernarse en buenas obras para los usos necesarios, para que no sean sin fruto.
PABLO, prisionero de Jesucristo, y el hermano Timoteo, á Filemón amado, y coadjutor nuestro;
Y á la amada Apphia, y á Archîpo, compañero de nuestra milicia, y á la iglesia que está en tu casa:
Gracia á vosotros y paz de Dios nuestro Padre, y del Señor Jesucristo.
Doy gracias á mi Dios, haciendo siempre memoria de ti en mis oraciones.
Oyendo tu caridad, y la fe que tienes en el Señor Jesús, y para con todos los santos;
Para que la comunicación de tu fe sea eficaz, en el conocimiento de todo el bien que está en vosotros, por Cristo Jesús.
Porque tenemos gran gozo y consolación de tu caridad, de que por ti, oh hermano, han sido recreadas las entrañas de los santos.
Por lo cual, aunque tengo mucha resolución en Cristo para mandarte lo que conviene,
Ruégote más bien por amor, siendo tal cual soy, Pablo viejo, y aun ahora prisionero de Jesucristo:
Ruégote por mi hijo Onésimo, que he engendrado en mis prisiones,
El cual en otro tiempo te fué inútil, mas ahora á ti y á mí es útil;
El cual te vuelvo á enviar; tú pues, recíbele como á mis entrañas.
Yo quisiera detenerle conmigo, para que en lugar de ti me sirviese en las prisiones del evangelio;
Mas nada quise hacer sin tu consejo, porque tu beneficio no fuese como de necesidad, sino voluntario.
Porque acaso por esto se ha apartado de ti por algún tiempo, para que le recibieses para siempre;
No ya como siervo, antes más que siervo, como hermano amado, mayormente de mí, pero cuánto más de ti, en la carne y en el Señor.
Así que, si me tienes por compañero, recíbele como á mí.
Y si en algo te dañó, ó te debe, ponlo á mi cuenta.
Yo Pablo lo escribí de mi mano, yo lo pagaré: por no decirte que aun á ti mismo te me debes demás.
Sí, hermano, góceme yo de ti en el Señor; recrea mis entrañas en el Señor.
Te he escrito confiando en tu obediencia, sabiendo que aun harás más de lo que digo.
Y asimismo prepárame también alojamiento; porque espero que por vuestras oraciones os tengo de ser concedido.
Te saludan Epafras, mi compañero en la prisión por Cristo Jesús,
Marcos, Aristarco, Demas y Lucas, mis cooperadores.
La gracia de nuestro Señor Jesucristo sea con vuestro espíritu. Amén. A Filemón fué enviada de Roma por Onésimo, siervo.
DIOS, habiendo hablado muchas veces y en muchas maneras en otro tiempo á los padres por los profetas,
En estos postreros días nos ha hablado por el Hijo, al cual constituyó heredero de todo, por el cual asimismo hizo el universo:
Hecho tanto más excelente que los ángeles, cuanto alcanzó por herencia más excelente nombre que ellos.
Porque ¿á cuál de los ángeles dijo Dios jamás: Mi hijo eres tú, hoy yo te he engendrado? y otra vez: Yo seré á él Padre, y él me será á mí hijo?
Y otra vez, cuando introduce al Primogénito en la tierra, dice: Y adórenle todos los ángeles de Dios.
Y ciertamente de los ángeles dice: El que hace á sus ángeles espíritus, y á sus ministros llama de fuego.
Mas al hijo: Tu trono, oh Dios, por el siglo del siglo; vara de equidad la vara de tu reino;
Has amado la justicia, y aborrecido la maldad; por lo cual te ungió Dios, el Dios tuyo, con óleo de alegría más que á tus compañeros.
Y: Tú, oh Señor, en el principio fundaste la tierra; y los cielos son obras de tus manos:
Ellos perecerán, mas tú eres permanente; y todos ellos se envejecerán como una vestidura;
Y como un vestido los envolverás, y serán mudados; empero tú eres el mismo, y tus años no acabarán.
Pues, ¿á cuál de los ángeles dijo jamás: Siéntate á mi diestra, hasta que ponga á tus enemigos por estrado de tus pies?
¿No son todos espíritus administradores, enviados para servicio á favor de los que serán herederos de salud?
POR tanto, es menester que con más diligencia atendamos á las cosas que hemos oído, porque acaso no nos escurramos.
Porque si la palabra dicha por los ángeles fué firme, y toda rebelión y desobediencia recibió justa paga de retribución,
¿Cómo escaparemos nosotros, si tuviéremos en poco una salud tan grande? La cual, habiendo comenzado á ser publicada por el Señor, ha sido confirmada hasta nosotros por los que oyeron;
Testificando juntamente con ellos Dios, con señales y milagros, y diversas maravillas, y repartimientos del Espíritu Santo según su voluntad.
Porque no sujetó á los ángeles el mundo venidero, del cual hablamos.
Testificó empero uno en cierto lugar, diciendo: ¿Qué es el hombre, que te acuerdas de él? ¿ó el hijo del hombre, que le visitas?
Tú le hiciste un poco menor que los ángeles, coronástele de gloria y de honra, y pusístele sobre las obras de tus manos;
Todas las cosas sujetaste debajo de sus pies. Porque en cuanto le sujetó todas las cosas, nada dejó que no sea sujeto á él; mas aun no vemos que todas las cosas le sean sujetas.
Empero vemos coronado de gloria y de honra, por el padecimiento de muerte, á aquel Jesús que es hecho un poco menor que los ángeles, para que por gracia de Dios gustase la muerte por todos.
Porque el que santifica y los que son santificados, de uno son todos: por lo cual no se avergüenza de llamarlos hermanos,
Diciendo: Anunciaré á mis hermanos tu nombre, en medio de la congregación te alabaré.
Y otra vez: Yo confiaré en él. Y otra vez: He aquí, yo y los hijos que me dió Dios.
Y librar á los que por el temor de la muerte estaban por toda la vida sujetos á servidumbre.
Porque ciertamente no tomó á los ángeles, sino á la simiente de Abraham tomó.
Porque en cuanto él mismo padeció siendo tentado, es poderoso para socorrer á los que son tentados.
POR tanto, hermanos santos, participantes de la vocación celestial, considerad al Apóstol y Pontífice de nuestra profesión, Cristo Jesús;
El cual es fiel al que le constituyó, como también lo fué Moisés sobre toda su casa.
Porque de tanto mayor gloria que Moisés éste es estimado digno, cuanto tiene mayor dignidad que la casa el que la fabricó.
Porque toda casa es edificada de alguno: mas el que crió todas las cosas es Dios.
Y Moisés á la verdad fué fiel sobre toda su casa, como siervo, para testificar lo que se había de decir;
Mas Cristo como hijo, sobre su casa; la cual casa somos nosotros, si hasta el cabo retuviéremos firme la confianza y la gloria de la esperanza.
Por lo cual, como dice el Espíritu Santo: Si oyereis hoy su voz,
No endurezcáis vuestros corazones como en la provocación, en el día de la tentación en el desierto,
Donde me tentaron vuestros padres; me probaron, y vieron mis obras cuarenta años.
A causa de lo cual me enemisté con esta generación, y dije: Siempre divagan ellos de corazón, y no han conocido mis caminos.
Juré, pues, en mi ira: No entrarán en mi reposo.
Mirad, hermanos, que en ninguno de vosotros haya corazón malo de incredulidad para apartarse del Dios vivo:
Antes exhortaos los unos á los otros cada día, entre tanto que se dice Hoy; porque ninguno de vosotros se endurezca con engaño de pecado:
Porque participantes de Cristo somos hechos, con tal que conservemos firme hasta el fin el principio de nuestra confianza;
Entre tanto que se dice: Si oyereis hoy su voz, no endurezcáis vuestros corazones, como en la provocación.
Porque algunos de los que habían salido de Egipto con Moisés, habiendo oído, provocaron, aunque no todos.
Mas ¿con cuáles estuvo enojado cuarenta años? ¿No fué con los que pecaron, cuyos cuerpos cayeron en el desierto?
¿Y á quiénes juró que no entrarían en su reposo, sino á aquellos que no obedecieron?
Y vemos que no pudieron entrar á causa de incredulidad.
TEMAMOS, pues, que quedando aún la promesa de entrar en su reposo, parezca alguno de vosotros haberse apartado.
Porque también á nosotros se nos ha evangelizado como á ellos; mas no les aprovechó el oir la palabra á los que la oyeron sin mezclar fe.
Empero entramos en el reposo los que hemos creído, de la manera que dijo: Como juré en mi ira, no entrarán en mi reposo: aun acabadas las obras desde el principio del mundo.
Porque en un cierto lugar dijo así del séptimo día: Y reposó Dios de todas sus obras en el séptimo día.
Y otra vez aquí: No entrarán en mi reposo.
Así que, pues que resta que algunos han de entrar en él, y aquellos á quienes primero fué anunciado no entraron por causa de desobediencia,
Determina otra vez un cierto día, diciendo por David: Hoy, después de tanto tiempo; como está dicho: Si oyereis su voz hoy, no endurezcáis vuestros corazones.
Porque si Josué les hubiera dado el reposo, no hablaría después de otro día.
Por tanto, queda un reposo para el pueblo de Dios.
Porque el que ha entrado en su reposo, también él ha reposado de sus obras, como Dios de las suyas.
Procuremos pues de entrar en aquel reposo; que ninguno caiga en semejante ejemplo de desobediencia.
Y no hay cosa criada que no sea manifiesta en su presencia; antes todas las cosas están desnudas y abiertas á los ojos de aquel á quien tenemos que dar cuenta.
Por tanto, teniendo un gran Pontífice, que penetró los cielos, Jesús el Hijo de Dios, retengamos nuestra profesión.
Porque no tenemos un Pontífice que no se pueda compadecer de nuestras flaquezas; mas tentado en todo según nuestra semejanza, pero sin pecado.
Lleguémonos pues confiadamente al trono de la gracia, para alcanzar misericordia, y hallar gracia para el oportuno socorro.
PORQUE todo pontífice, tomado de entre los hombres, es constituído á favor de los hombres en lo que á Dios toca, para que ofrezca presentes y sacrificios por los pecados:
Que se pueda compadecer de los ignorantes y extraviados, pues que él también está rodeado de flaqueza;
Y por causa de ella debe, como por sí mismo, así también por el pueblo, ofrecer por los pecados.
Ni nadie toma para sí la honra, sino el que es llamado de Dios, como Aarón.
Así también Cristo no se glorificó á sí mismo haciéndose Pontífice, mas el que le dijo: Tú eres mi Hijo, yo te he engendrado hoy;
Como también dice en otro lugar: Tú eres sacerdote eternamente, según el orden de Melchîsedec.
El cual en los días de su carne, ofreciendo ruegos y súplicas con gran clamor y lágrimas al que le podía librar de la muerte, fué oído por su reverencial miedo.
Y aunque era Hijo, por lo que padeció aprendió la obediencia;
Y consumado, vino á ser causa de eterna salud á todos los que le obedecen;
Nombrado de Dios pontífice según el orden de Melchîsedec.
Del cual tenemos mucho que decir, y dificultoso de declarar, por cuanto sois flacos para oir.
Que cualquiera que participa de la leche, es inhábil para la palabra de la justicia, porque es niño;
Mas la vianda firme es para los perfectos, para los que por la costumbre tienen los sentidos ejercitados en el discernimiento del bien y del mal.
POR tanto, dejando la palabra del comienzoen la doctrinade Cristo, vamos adelante á la perfección; no echando otra vez el fundamento del arrepentimiento de obras muertas, y de la fe en Dios,
De la doctrina de bautismos, y de la imposición de manos, y de la resurrección de los muertos, y del juicio eterno.
Y esto haremos á la verdad, si Dioslopermitiere.
Porque es imposible que los que una vez fueron iluminados y gustaron el don celestial, y fueron hechos partícipes del Espíritu Santo,
Y asimismo gustaron la buena palabra de Dios, y las virtudes del siglo venidero,
Y recayeron, sean otra vez renovados para arrepentimiento, crucificando de nuevo para sí mismos al Hijo de Dios, y exponiéndole á vituperio.
Porque la tierra que embebe el agua que muchas veces vino sobre ella, y produce hierba provechosa á aquellos de los cuales es labrada, recibe bendición de Dios:
Mas la que produce espinas y abrojos, es reprobada, y cercana de maldición; cuyo fin será el ser abrasada.
Pero de vosotros, oh amados, esperamos mejores cosas, y más cercanas á salud, aunque hablamos así.
Porque Dios no es injusto para olvidar vuestra obra y el trabajo de amor que habéis mostrado á su nombre, habiendo asistido y asistiendo aún á los santos.
Mas deseamos que cada uno de vosotros muestre la misma solicitud hasta el cabo, para cumplimiento de la esperanza:
Que no os hagáis perezosos, mas imitadores de aquellos que por la fe y la paciencia heredan las promesas.
Porque prometiendo Dios á Abraham, no pudiendo jurar por otro mayor, juró por sí mismo,
Diciendo: De cierto te bendeciré bendiciendo, y multiplicando te multiplicaré.
Y así, esperando con largura de ánimo, alcanzó la promesa.
Porque los hombres ciertamente por el mayor que ellos juran: y el fin de todas sus controversias es el juramento para confirmación.
Por lo cual, queriendo Dios mostrar más abundantemente á los herederos de la promesa la inmutabilidad de su consejo, interpuso juramento;
Para que por dos cosas inmutables, en las cuales es imposible que Dios mienta, tengamos un fortísimo consuelo, los que nos acogemos á trabarnos de la esperanza propuesta:
La cual tenemos como segura y firme ancla del alma, y que entra hasta dentro del velo;
Donde entró por nosotros como precursor Jesús, hecho Pontífice eternalmente según el orden de Melchîsedec.
PORQUE este Melchîsedec, rey de Salem, sacerdote del Dios Altísimo, el cual salió á recibir á Abraham que volvía de la derrota de los reyes, y le bendijo,
Al cual asimismo dió Abraham los diezmos de todo, primeramente él se interpreta Rey de justicia; y luego también Rey de Salem, que es, Rey de paz;
Sin padre, sin madre, sin linaje; que ni tiene principio de días, ni fin de vida, mas hecho semejante al Hijo de Dios, permanece sacerdote para siempre.
Mirad pues cuán grande fué éste, al cual aun Abraham el patriarca dió diezmos de los despojos.
Mas aquél cuya genealogía no es contada de ellos, tomó de Abraham los diezmos, y bendijo al que tenía las promesas.
Y sin contradicción alguna, lo que es menos es bendecido de lo que es más.
Y aquí ciertamente los hombres mortales toman los diezmos: mas allí, aquel del cual está dado testimonio que vive.
Y, por decirlo así, en Abraham fué diezmado también Leví, que recibe los diezmos;
Porque aun estaba en los lomos de su padre cuando Melchîsedec le salió al encuentro.
Pues mudado el sacerdocio, necesario es que se haga también mudanza de la ley.
Porque aquel del cual esto se dice, de otra tribu es, de la cual nadie asistió al altar.
Porque notorio es que el Señor nuestro nació de la tribu de Judá, sobre cuya tribu nada habló Moisés tocante al sacerdocio.
Y aun más manifiesto es, si á semejanza de Melchîsedec se levanta otro sacerdote,
El cual no es hecho conforme á la ley del mandamiento carnal, sino según la virtud de vida indisoluble;
Pues se da testimonio de él: Tú eres sacerdote para siempre, según el orden de Melchîsedec.
El mandamiento precedente, cierto se abroga por su flaqueza é inutilidad;
Porque nada perfeccionó la ley; mas hízolo la introducción de mejor esperanza, por la cual nos acercamos á Dios.
Y por cuanto no fué sin juramento,
Tanto de mejor testamento es hecho fiador Jesús.
Y los otros cierto fueron muchos sacerdotes, en cuanto por la muerte no podían permanecer.
Mas éste, por cuanto permanece para siempre, tiene un sacerdocio inmutable:
Por lo cual puede también salvar eternamente á los que por él se allegan á Dios, viviendo siempre para interceder por ellos.
Porque tal pontífice nos convenía: santo, inocente, limpio, apartado de los pecadores, y hecho más sublime que los cielos;
Que no tiene necesidad cada día, como los otros sacerdotes, de ofrecer primero sacrificios por sus pecados, y luego por los del pueblo: porque esto lo hizo una sola vez, ofreciéndose á sí mismo.
Porque la ley constituye sacerdotes á hombres flacos; mas la palabra del juramento, después de la ley, constituye al Hijo, hecho perfecto para siempre.
ASÍ que, la suma acerca de lo dicho es: Tenemos tal pontífice que se asentó á la diestra del trono de la Majestad en los cielos;
Ministro del santuario, y de aquel verdadero tabernáculo que el Señor asentó, y no hombre.
Porque todo pontífice es puesto para ofrecer presentes y sacrificios; por lo cual es necesario que también éste tuviese algo que ofrecer.
Así que, si estuviese sobre la tierra, ni aun sería sacerdote, habiendo aún los sacerdotes que ofrecen los presentes según la ley;
Mas ahora tanto mejor ministerio es el suyo, cuanto es mediador de un mejor pacto, el cual ha sido formado sobre mejores promesas.
Porque si aquel primero fuera sin falta, cierto no se hubiera procurado lugar de segundo.
Porque reprendiéndolos dice: He aquí vienen días, dice el Señor, y consumaré para con la casa de Israel y para con la casa de Judá un nuevo pacto;
Y ninguno enseñará á su prójimo, ni ninguno á su hermano, diciendo: Conoce al Señor: porque todos me conocerán, desde el menor de ellos hasta el mayor.
Porque seré propicio á sus injusticias, y de sus pecados y de sus iniquidades no me acordaré más.
Diciendo, Nuevo pacto, dió por viejo al primero; y lo que es dado por viejo y se envejece, cerca está de desvanecerse.
TENÍA empero también el primerpactoreglamentos del culto, y santuario mundano.
Porque el tabernáculo fué hecho: el primero, en que estabanlas lámparas, y la mesa, y los panes de la proposición; lo que llaman el Santuario.
Tras el segundo veloestabael tabernáculo, que llaman el Lugar Santísimo;
Y sobre ella los querubines de gloria que cubrían el propiciatorio; de las cuales cosas no se puede ahora hablar en particular.
Y estas cosas así ordenadas, en el primer tabernáculo siempre entraban los sacerdotes para hacer los oficios del culto;
Mas en el segundo, sólo el pontífice una vez en el año, no sin sangre, la cual ofrece por sí mismo, y por los pecados de ignorancia del pueblo:
Dando en esto á entender el Espíritu Santo, que aun no estaba descubierto el camino para el santuario, entre tanto que el primer tabernáculo estuviese en pie.
Lo cual era figura de aquel tiempo presente, en el cual se ofrecían presentes y sacrificios que no podían hacer perfecto, cuanto á la conciencia, al que servía con ellos;
Consistiendo sólo en viandas y en bebidas, y en diversos lavamientos, y ordenanzas acerca de la carne, impuestas hasta el tiempo de la corrección.
Mas estando ya presente Cristo, pontífice de los bienes que habían de venir, por el más amplio y más perfecto tabernáculo, no hecho de manos, es á saber, no de esta creación;
Y no por sangre de machos cabríos ni de becerros, mas por su propia sangre, entró una sola vez en el santuario, habiendo obtenido eterna redención.
Porque si la sangre de los toros y de los machos cabríos, y la ceniza de la becerra, rociada á los inmundos, santifica para la purificación de la carne,
¿Cuánto más la sangre de Cristo, el cual por el Espíritu eterno se ofreció á sí mismo sin mancha á Dios, limpiará vuestras conciencias de las obras de muerte para que sirváis al Dios vivo?
Porque donde hay testamento, necesario es que intervenga muerte del testador.
Porque el testamento con la muerte es confirmado; de otra manera no es válido entre tanto que el testador vive.
De donde vino que ni aun el primero fué consagrado sin sangre.
Diciendo: Esta es la sangre del testamento que Dios os ha mandado.
Y además de esto roció también con la sangre el tabernáculo y todos los vasos del ministerio.
Y casi todo es purificado según la ley con sangre; y sin derramamiento de sangre no se hace remisión.
Fué, pues, necesario que las figuras de las cosas celestiales fuesen purificadas con estas cosas; empero las mismas cosas celestiales con mejores sacrificios que éstos.
Porque no entró Cristo en el santuario hecho de mano, figura del verdadero, sino en el mismo cielo para presentarse ahora por nosotros en la presencia de Dios.
Y no para ofrecerse muchas veces á sí mismo, como entra el pontífice en el santuario cada año con sangre ajena;
Y de la manera que está establecido á los hombres que mueran una vez, y después el juicio;
Así también Cristo fué ofrecido una vez para agotar los pecados de muchos; y la segunda vez, sin pecado, será visto de los que le esperan para salud.
De otra manera cesarían de ofrecerse; porque los que tributan este culto, limpios de una vez, no tendrían más conciencia de pecado.
Empero en estos sacrificios cada año se hace conmemoración de los pecados.
Porque la sangre de los toros y de los machos cabríos no puede quitar los pecados.
Por lo cual, entrando en el mundo, dice: Sacrificio y presente no quisiste; mas me apropiaste cuerpo:
Holocaustos y expiaciones por el pecado no te agradaron.
Entonces dije: Heme aquí (en la cabecera del libro está escrito de mí) para que haga, oh Dios, tu voluntad.
Diciendo arriba: Sacrificio y presente, y holocaustos y expiaciones por el pecado no quisiste, ni te agradaron, (las cuales cosas se ofrecen según la ley,)
Entonces dijo: Heme aquí para que haga, oh Dios, tu voluntad. Quita lo primero, para establecer lo postrero.
En la cual voluntad somos santificados por la ofrenda del cuerpo de Jesucristo hecha una sola vez.
Así que, todo sacerdote se presenta cada día ministrando y ofreciendo muchas veces los mismos sacrificios, que nunca pueden quitar los pecados:
Pero éste, habiendo ofrecido por los pecados un solo sacrificio para siempre, está sentado á la diestra de Dios,
Esperando lo que resta, hasta que sus enemigos sean puestos por estrado de sus pies.
Porque con una sola ofrenda hizo perfectos para siempre á los santificados.
Y atestíguanos lo mismo el Espíritu Santo; que después que dijo:
Y este es el pacto que haré con ellos después de aquellos días, dice el Señor: Daré mis leyes en sus corazones, y en sus almas las escribiré;
Añade: Y nunca más me acordaré de sus pecados é iniquidades.
Pues donde hay remisión de éstos, no hay más ofrenda por pecado.
Así que, hermanos, teniendo libertad para entrar en el santuario por la sangre de Jesucristo,
Por el camino que él nos consagró nuevo y vivo, por el velo, esto es, por su carne;
Y teniendo un gran sacerdote sobre la casa de Dios,
Lleguémonos con corazón verdadero, en plena certidumbre de fe, purificados los corazones de mala conciencia, y lavados los cuerpos con agua limpia.
Mantengamos firme la profesión de nuestra fe sin fluctuar; que fiel es el que prometió:
Y considerémonos los unos á los otros para provocarnos al amor y á las buenas obras;
No dejando nuestra congregación, como algunos tienen por costumbre, mas exhortándonos; y tanto más, cuanto veis que aquel día se acerca.
Porque si pecáremos voluntariamente después de haber recibido el conocimiento de la verdad, ya no queda sacrificio por el pecado.
Sino una horrenda esperanza de juicio, y hervor de fuego que ha de devorar á los adversarios.
El que menospreciare la ley de Moisés, por el testimonio de dos ó de tres testigos muere sin ninguna misericordia:
Sabemos quién es el que dijo: Mía es la venganza, yo daré el pago, dice el Señor. Y otra vez: El Señor juzgará su pueblo.
Horrenda cosa es caer en las manos del Dios vivo.
Empero traed á la memoria los días pasados, en los cuales, después de haber sido iluminados, sufristeis gran combate de aflicciones:
Por una parte, ciertamente, con vituperios y tribulaciones fuisteis hechos espectáculo; y por otra parte hechos compañeros de los que estaban en tal estado.
Porque de mis prisiones también os resentisteis conmigo, y el robo de vuestros bienes padecisteis con gozo, conociendo que tenéis en vosotros una mejor sustancia en los cielos, y que permanece.
No perdáis pues vuestra confianza, que tiene grande remuneración de galardón:
Porque la paciencia os es necesaria; para que, habiendo hecho la voluntad de Dios, obtengáis la promesa.
Porque aun un poquito, y el que ha de venir vendrá, y no tardará.
Ahora el justo vivirá por fe; mas si se retirare, no agradará á mi alma.
Pero nosotros no somos tales que nos retiremos para perdición, sino fieles para ganancia del alma.
ES pues la fe la sustancia de las cosas que se esperan, la demostración de las cosas que no se ven.
Porque por ella alcanzaron testimonio los antiguos.
Por la fe entendemos haber sido compuestos los siglos por la palabra de Dios, siendo hecho lo que se ve, de lo que no se veía.
Empero sin fe es imposible agradar á Dios; porque es menester que el que á Dios se allega, crea que le hay, y que es galardonador de los que le buscan.
Por la fe Abraham, siendo llamado, obedeció para salir al lugar que había de recibir por heredad; y salió sin saber dónde iba.
Por fe habitó en la tierra prometida como en tierra ajena, morando en cabañas con Isaac y Jacob, herederos juntamente de la misma promesa:
Porque esperaba ciudad con fundamentos, el artífice y hacedor de la cual es Dios.
Por la fe también la misma Sara, siendo estéril, recibió fuerza para concebir simiente; y parió aun fuera del tiempo de la edad, porque creyó ser fiel el que lo había prometido.
Por lo cual también, de uno, y ése ya amortecido, salieron como las estrellas del cielo en multitud, y como la arena innumerable que está á la orilla de la mar.
Conforme á la fe murieron todos éstos sin haber recibido las promesas, sino mirándolas de lejos, y creyéndolas, y saludándolas, y confesando que eran peregrinos y advenedizos sobre la tierra.
Porque los que esto dicen, claramente dan á entender que buscan una patria.
Que si se acordaran de aquella de donde salieron, cierto tenían tiempo para volverse:
Empero deseaban la mejor, es á saber, la celestial; por lo cual Dios no se avergüenza de llamarse Dios de ellos: porque les había aparejado ciudad.
Por fe ofreció Abraham á Isaac cuando fué probado, y ofrecía al unigénito el que había recibido las promesas,
Habiéndole sido dicho: En Isaac te será llamada simiente:
Pensando que aun de los muertos es Dios poderoso para levantar; de donde también le volvió á recibir por figura.
Por fe bendijo Isaac á Jacob y á Esaú respecto á cosas que habían de ser.
Por fe Jacob, muriéndose, bendijo á cada uno de los hijos de José, y adoró estribando sobre la punta de su bordón.
Por fe José, muriéndose, se acordó de la partida de los hijos de Israel; y dió mandamiento acerca de sus huesos.
Por fe Moisés, nacido, fué escondido de sus padres por tres meses, porque le vieron hermoso niño; y no temieron el mandamiento del rey.
Por fe Moisés, hecho ya grande, rehusó ser llamado hijo de la hija de Faraón;
Escogiendo antes ser afligido con el pueblo de Dios, que gozar de comodidades temporales de pecado.
Teniendo por mayores riquezas el vituperio de Cristo que los tesoros de los Egipcios; porque miraba á la remuneración.
Por fe dejó á Egipto, no temiendo la ira del rey; porque se sostuvo como viendo al Invisible.
Por fe celebró la pascua y el derramamiento de la sangre, para que el que mataba los primogénitos no los tocase.
Por fe pasaron el mar Bermejo como por tierra seca: lo cual probando los Egipcios, fueron sumergidos.
Por fe cayeron los muros de Jericó con rodearlos siete días.
Por fe Rahab la ramera no pereció juntamente con los incrédulos, habiendo recibido á los espías con paz.
¿Y qué más digo? porque el tiempo me faltará contando de Gedeón, de Barac, de Samsón, de Jephté, de David, de Samuel, y de los profetas:
Que por fe ganaron reinos, obraron justicia, alcanzaron promesas, taparon las bocas de leones,
Apagaron fuegos impetuosos, evitaron filo de cuchillo, convalecieron de enfermedades, fueron hechos fuertes en batallas, trastornaron campos de extraños.
Las mujeres recibieron sus muertos por resurrección; unos fueron estirados, no aceptando el rescate, para ganar mejor resurrección;
Otros experimentaron vituperios y azotes; y á más de esto prisiones y cárceles;
Fueron apedreados, aserrados, tentados, muertos á cuchillo; anduvieron de acá para allá cubiertos de pieles de ovejas y de cabras, pobres, angustiados, maltratados;
De los cuales el mundo no era digno; perdidos por los desiertos, por los montes, por las cuevas y por las cavernas de la tierra.
Y todos éstos, aprobados por testimonio de la fe, no recibieron la promesa;
Proveyendo Dios alguna cosa mejor para nosotros, para que no fuesen perfeccionados sin nosotros.
Puestos los ojos en al autor y consumador de la fe, enJesús; el cual, habiéndole sido propuesto gozo, sufrió la cruz, menospreciando la vergüenza, y sentóse á la diestra del trono de Dios.
Reducid pues á vuestro pensamiento á aquel que sufrió tal contradicción de pecadores contra sí mismo, porque no os fatiguéis en vuestros ánimos desmayando.
Que aun no habéis resistido hasta la sangre, combatiendo contra el pecado:
Y estáis ya olvidados de la exhortación que como con hijos habla con vosotros, diciendo: Hijo mío, no menosprecies el castigo del Señor, ni desmayes cuando eres de él reprendido.
Porque el Señor al que ama castiga, y azota á cualquiera que recibe por hijo.
Si sufrís el castigo, Dios se os presenta como á hijos; porque ¿qué hijo es aquel á quien el padre no castiga?
Mas si estáis fuera del castigo, del cual todos han sido hechos participantes, luego sois bastardos, y no hijos.
Por otra parte, tuvimos por castigadores á los padres de nuestra carne, y los reverenciábamos, ¿por qué no obedeceremos mucho mejor al Padre de los espíritus, y viviremos?
Y aquéllos, á la verdad, por pocos días nos castigaban como á ellos les parecía, mas éste para lo que nos es provechoso, para que recibamos su santificación.
Es verdad que ningún castigo al presente parece ser causa de gozo, sino de tristeza; mas después da fruto apacible de justicia á los que en él son ejercitados.
Por lo cual alzad las manos caídas y las rodillas paralizadas;
Y haced derechos pasos á vuestros pies, porque lo que es cojo no salga fuera de camino, antes sea sanado.
Seguid la paz con todos, y la santidad, sin la cual nadie verá al Señor:
Mirando bien que ninguno se aparte de la gracia de Dios, que ninguna raíz de amargura brotando os impida, y por ella muchos sean contaminados;
Que ninguno sea fornicario, ó profano, como Esaú, que por una vianda vendió su primogenitura.
Porque ya sabéis que aun después, deseando heredar la bendición, fué reprobado (que no halló lugar de arrepentimiento), aunque la procuró con lágrimas.
Porque no os habéis llegado al monte que se podía tocar, y al fuego encendido, y al turbión, y á la oscuridad, y á la tempestad,
Y al sonido de la trompeta, y á la voz de las palabras, la cual los que la oyeron rogaron que no se les hablase más;
Porque no podían tolerar lo que se mandaba: Si bestia tocare al monte, será apedreada, ó pasada con dardo.
Y tan terrible cosa era lo que se veía, que Moisés dijo: Estoy asombrado y temblando.
Mas os habéis llegado al monte de Sión, y á la ciudad del Dios vivo, Jerusalem la celestial, y á la compañía de muchos millares de ángeles,
Y á la congregación de los primogénitos que están alistados en los cielos, y á Dios el Juez de todos, y á los espíritus de los justos hechos perfectos,
Y á Jesús el Mediador del nuevo testamento, y á la sangre del esparcimiento que habla mejor que la de Abel.
Mirad que no desechéis al que habla. Porque si aquellos no escaparon que desecharon al que hablaba en la tierra, mucho menos nosotros, si desecháramos al que habla de los cielos.
La voz del cual entonces conmovió la tierra; mas ahora ha denunciado, diciendo: Aun una vez, y yo conmoveré no solamente la tierra, mas aun el cielo.
Y esta palabra, Aun una vez, declara la mudanza de las cosas movibles, como de cosas hechas, para que queden las cosas que son firmes.
Así que, tomando el reino inmóvil, retengamos la gracia por la cual sirvamos á Dios agradándole con temor y reverencia;
Porque nuestro Dios es fuego consumidor.
PERMANEZCA el amor fraternal.
No olvidéis la hospitalidad, porque por ésta algunos, sin saberlo, hospedaron ángeles.
Acordaos de los presos, como presos juntamente con ellos; y de los afligidos, como que también vosotros mismos sois del cuerpo.
Honroso es en todos el matrimonio, y el lecho sin mancilla; mas á los fornicarios y á los adúlteros juzgará Dios.
Sean las costumbres vuestras sin avaricia; contentos de lo presente; porque él dijo: No te desampararé, ni te dejaré.
De tal manera que digamos confiadamente: El Señor es mi ayudador; no temeré lo que me hará el hombre.
Acordaos de vuestros pastores, que os hablaron la palabra de Dios; la fe de los cuales imitad, considerando cuál haya sido el éxito de su conducta.
Jesucristo es el mismo ayer, y hoy, y por los siglos.
No seáis llevados de acá para allá por doctrinas diversas y extrañas; porque buena cosa es afirmar el corazón en la gracia, no en viandas, que nunca aprovecharon á los que anduvieron en ellas.
Tenemos un altar, del cual no tienen facultad de comer los que sirven al tabernáculo.
Porque los cuerpos de aquellos animales, la sangre de los cuales es metida por el pecado en el santuario por el pontífice, son quemados fuera del real.
Por lo cual también Jesús, para santificar al pueblo por su propia sangre, padeció fuera de la puerta.
Salgamos pues á él fuera del real, llevando su vituperio.
Porque no tenemos aquí ciudad permanente, mas buscamos la por venir.
Así que, ofrezcamos por medio de él á Dios siempre sacrificio de alabanza, es á saber, fruto de labios que confiesen á su nombre.
Y de hacer bien y de la comunicación no os olvidéis: porque de tales sacrificios se agrada Dios.
Orad por nosotros: porque confiamos que tenemos buena conciencia, deseando conversar bien en todo.
Y más os ruego que lo hagáis así, para que yo os sea más presto restituído.
Y el Dios de paz que sacó de los muertos á nuestro Señor Jesucristo, el gran pastor de las ovejas, por la sangre del testamento eterno,
Os haga aptos en toda obra buena para que hagáis su voluntad, haciendo él en vosotros lo que es agradable delante de él por Jesucristo: al cual sea gloria por los siglos de los siglos. Amén.
Empero os ruego, hermanos, que soportéis la palabra de exhortación; porque os he escrito en breve.
Sabed que nuestro hermano Timoteo está suelto; con el cual, si viniere más presto, os iré á ver.
Saludad á todos vuestros pastores, y á todos los santos. Los de Italia os saludan.
JACOBO, siervo de Dios y del Señor Jesucristo, á las doce tribus que están esparcidas, salud.
Hermanos míos, tened por sumo gozo cuando cayereis en diversas tentaciones;
Sabiendo que la prueba de vuestra fe obra paciencia.
Mas tenga la paciencia perfectasuobra, para que seáis perfectos y cabales, sin faltar en alguna cosa.
Y si alguno de vosotros tiene falta de sabiduría, demándela á Dios, el cual da á todos abundantemente, y no zahiere; y le será dada.
Pero pida en fe, no dudando nada: porque el que duda es semejante á la onda de la mar, que es movida del viento, y echada de una parte á otra.
No piense pues el tal hombre que recibirá ninguna cosa del Señor.
El hombre de doblado ánimo es inconstante en todos sus caminos.
El hermano que es de baja suerte, gloríese en su alteza:
Mas el que es rico, en su bajeza; porque él se pasará como la flor de la hierba.
Porque salido el sol con ardor, la hierba se secó, y su flor se cayó, y pereció su hermosa apariencia: así también se marchitará el rico en todos sus caminos.
Bienaventurado el varón que sufre la tentación; porque cuando fuere probado, recibirá la corona de vida, que Dios ha prometido á los que le aman.
Cuando alguno es tentado, no diga que es tentado de Dios: porque Dios no puede ser tentado de los malos, ni él tienta á alguno:
Sino que cada uno es tentado, cuando de su propia concupiscencia es atraído, y cebado.
Y la concupiscencia, después que ha concebido, pare el pecado: y el pecado, siendo cumplido, engendra muerte.
Amados hermanos míos, no erréis.
Toda buena dádiva y todo don perfecto es de lo alto, que desciende del Padre de las luces, en el cual no hay mudanza, ni sombra de variación.
El, de su voluntad nos ha engendrado por la palabra de verdad, para que seamos primicias de sus criaturas.
Por esto, mis amados hermanos, todo hombre sea pronto para oir, tardío para hablar, tardío para airarse:
Porque la ira del hombre no obra la justicia de Dios.
Por lo cual, dejando toda inmundicia y superfluidad de malicia, recibid con mansedumbre la palabra ingerida, la cual puede hacer salvas vuestras almas.
Mas sed hacedores de la palabra, y no tan solamente oidores, engañándoos á vosotros mismos.
Porque si alguno oye la palabra, y no la pone por obra, este tal es semejante al hombre que considera en un espejo su rostro natural.
Porque él se consideró á sí mismo, y se fué, y luego se olvidó qué tal era.
Si alguno piensa ser religioso entre vosotros, y no refrena su lengua, sino engañando su corazón, la religión del tal es vana.
La religión pura y sin mácula delante de Dios y Padre es esta: Visitar los huérfanos y las viudas en sus tribulaciones, y guardarse sin mancha de este mundo.
HERMANOS míos, no tengáis la fe de nuestro Señor Jesucristo glorioso en acepción de personas.
Porque si en vuestra congregación entra un hombre con anillo de oro, y de preciosa ropa, y también entra un pobre con vestidura vil,
Y tuviereis respeto al que trae la vestidura preciosa, y le dijereis: Siéntate tú aquí en buen lugar: y dijereis al pobre: Estáte tú allí en pie; ó siéntate aquí debajo de mi estrado:
¿No juzgáis en vosotros mismos, y venís á ser jueces de pensamientos malos?
Hermanos míos amados, oid: ¿No ha elegido Dios los pobres de este mundo, ricos en fe, y herederos del reino que ha prometido á los que le aman?
Mas vosotros habéis afrentado al pobre. ¿No os oprimen los ricos, y no son ellos los mismos que os arrastran á los juzgados?
¿No blasfeman ellos el buen nombre que fué invocado sobre vosotros?
Si en verdad cumplís vosotros la ley real, conforme á la Escritura: Amarás á tu prójimo como á ti mismo, bien hacéis:
Mas si hacéis acepción de personas, cometéis pecado, y sois reconvenidos de la ley como transgresores.
Porque cualquiera que hubiere guardado toda la ley, y ofendiere en un punto, es hecho culpado de todos.
Porque el que dijo: No cometerás adulterio, también ha dicho: No matarás. Ahora bien, si no hubieres cometido adulterio, pero hubieres matado, ya eres hecho transgresor de la ley.
Así hablad, y así obrad, como los que habéis de ser juzgados por la ley de libertad.
Porque juicio sin misericordia será hecho con aquel que no hiciere misericordia: y la misericordia se gloría contra el juicio.
Hermanos míos, ¿qué aprovechará si alguno dice que tiene fe, y no tiene obras? ¿Podrá la fe salvarle?
Y si el hermano ó la hermana están desnudos, y tienen necesidad del mantenimiento de cada día,
Y alguno de vosotros les dice: Id en paz, calentaos y hartaos; pero no les diereis las cosas que son necesarias para el cuerpo: ¿qué aprovechará?
Así también la fe, si no tuviere obras, es muerta en sí misma.
Pero alguno dirá: Tú tienes fe, y yo tengo obras: muéstrame tu fe sin tus obras, y yo te mostraré mi fe por mis obras.
Tú crees que Dios es uno; bien haces: también los demonios creen, y tiemblan.
¿Mas quieres saber, hombre vano, que la fe sin obras es muerta?
¿No fué justificado por las obras Abraham nuestro padre, cuando ofreció á su hijo Isaac sobre el altar?
¿No ves que la fe obró con sus obras, y que la fe fué perfecta por las obras?
Y fué cumplida la Escritura que dice: Abraham creyó á Dios, y le fué imputado á justicia, y fué llamado amigo de Dios.
Vosotros veis, pues, que el hombre es justificado por las obras, y no solamente por la fe.
Asimismo también Rahab la ramera, ¿no fué justificada por obras, cuando recibió los mensajeros, y los echó fuera por otro camino?
Porque como el cuerpo sin espíritu está muerto, así también la fe sin obras es muerta.
HERMANOS míos, no os hagáis muchos maestros, sabiendo que recibiremos mayor condenación.
Porque todos ofendemos en muchas cosas. Si alguno no ofende en palabra, éste es varón perfecto, que también puede con freno gobernar todo el cuerpo.
He aquí nosotros ponemos frenos en las bocas de los caballos para que nos obedezcan, y gobernamos todo su cuerpo.
Mirad también las naves: aunque tan grandes, y llevadas de impetuosos vientos, son gobernadas con un muy pequeño timón por donde quisiere el que las gobierna.
Así también, la lengua es un miembro pequeño, y se gloría de grandes cosas. He aquí, un pequeño fuego ¡cuán grande bosque enciende!
Y la lengua es un fuego, un mundo de maldad. Así la lengua está puesta entre nuestros miembros, la cual contamina todo el cuerpo, é inflama la rueda de la creación, y es inflamada del infierno.
Porque toda naturaleza de bestias, y de aves, y de serpientes, y de seres de la mar, se doma y es domada de la naturaleza humana:
Pero ningún hombre puede domar la lengua, que es un mal que no puede ser refrenado; llena de veneno mortal.
Con ella bendecimos al Dios y Padre, y con ella maldecimos á los hombres, los cuales son hechos á la semejanza de Dios.
De una misma boca proceden bendición y maldición. Hermanos míos, no conviene que estas cosas sean así hechas.
¿Echa alguna fuente por una misma abertura agua dulce y amarga?
Hermanos míos, ¿puede la higuera producir aceitunas, ó la vid higos? Así ninguna fuente puede hacer agua salada y dulce.
¿Quién es sabio y avisado entre vosotros? muestre por buena conversación sus obras en mansedumbre de sabiduría.
Pero si tenéis envidia amarga y contención en vuestros corazones, no os gloriéis, ni seáis mentirosos contra la verdad:
Que esta sabiduría no es la que desciende de lo alto, sino terrena, animal, diabólica.
Porque donde hay envidia y contención, allí hay perturbación y toda obra perversa.
Mas la sabiduría que es de lo alto, primeramente es pura, después pacífica, modesta, benigna, llena de misericordia y de buenos frutos, no juzgadora, no fingida.
Y el fruto de justicia se siembra en paz para aquellos que hacen paz.
¿DE dónde vienen las guerras y los pleitos entre vosotros? ¿No son de vuestras concupiscencias, las cuales combaten en vuestros miembros?
Codiciáis, y no tenéis; matáis y ardéis de envidia, y no podéis alcanzar; combatís y guerreáis, y no tenéis lo que deseáis, porque no pedís.
Pedís, y no recibís, porque pedís mal, para gastar en vuestros deleites.
Adúlteros y adúlteras, ¿no sabéis que la amistad del mundo es enemistad con Dios? Cualquiera pues que quisiere ser amigo del mundo, se constituye enemigo de Dios.
¿Pensáis que la Escritura dice sin causa: El espíritu que mora en nosotros codicia para envidia?
Mas él da mayor gracia. Por esto dice: Dios resiste á los soberbios, y da gracia á los humildes.
Someteos pues á Dios; resistid al diablo, y de vosotros huirá.
Allegaos á Dios, y él se allegará á vosotros. Pecadores, limpiad las manos; y vosotros de doblado ánimo, purificad los corazones.
Afligíos, y lamentad, y llorad. Vuestra risa se convierta en lloro, y vuestro gozo en tristeza.
Humillaos delante del Señor, y él os ensalzará.
Uno es el dador de la ley, que puede salvar y perder: ¿quién eres tú que juzgas á otro?
Ea ahora, los que decís: Hoy y mañana iremos á tal ciudad, y estaremos allá un año, y compraremos mercadería, y ganaremos:
Y no sabéis lo que será mañana. Porque ¿qué es vuestra vida? Ciertamente es un vapor que se aparece por un poco de tiempo, y luego se desvanece.
En lugar de lo cual deberíais decir: Si el Señor quisiere, y si viviéremos, haremos esto ó aquello.
Mas ahora os jactáis en vuestras soberbias. Toda jactancia semejante es mala.
El pecado, pues, está en aquel que sabe hacer lo bueno, y no lo hace.
EA ya ahora, oh ricos, llorad aullando por vuestras miserias que os vendrán.
Vuestras riquezas están podridas: vuestras ropas están comidas de polilla.
Vuestro oro y plata están corrompidos de orín; y su orín os será en testimonio, y comerá del todo vuestras carnes como fuego. Os habéis allegado tesoro para en los postreros días.
Habéis vivido en deleites sobre la tierra, y sido disolutos; habéis cebado vuestros corazones como en el día de sacrificios.
Habéis condenadoymuerto al justo; yél no os resiste.
Pues, hermanos, tened paciencia hasta la venida del Señor. Miradcómoel labrador espera el precioso fruto de la tierra, aguardando con paciencia, hasta que reciba la lluvia temprana y tardía.
Tened también vosotros paciencia; confirmad vuestros corazones: porque la venida del Señor se acerca.
Hermanos, no os quejéis unos contra otros, porque no seáis condenados; he aquí, el juez está delante de la puerta.
Hermanos míos, tomad por ejemplo de aflicción y de paciencia, á los profetas que hablaron en nombre del Señor.
He aquí, tenemos por bienaventurados á los que sufren. Habéis oído la paciencia de Job, y habéis visto el fin del Señor, que el Señor es muy misericordioso y piadoso.
Mas sobre todo, hermanos míos, no juréis, ni por el cielo, ni por la tierra, ni por otro cualquier juramento; sino vuestro sí sea sí, y vuestro no sea no; porque no caigáis en condenación.
¿Está alguno entre vosotros afligido? haga oración. ¿Está alguno alegre? cante salmos.
¿Está alguno enfermo entre vosotros? llame á los ancianos de la iglesia, y oren por él, ungiéndole con aceite en el nombre del Señor.
Y la oración de fe salvará al enfermo, y el Señor lo levantará; y si estuviere en pecados, le serán perdonados.
Confesaos vuestras faltas unos á otros, y rogad los unos por los otros, para que seáis sanos; la oración del justo, obrando eficazmente, puede mucho.
Elías era hombre sujeto á semejantes pasiones que nosotros, y rogó con oración que no lloviese, y no llovió sobre la tierra en tres años y seis meses.
Y otra vez oró, y el cielo dió lluvia, y la tierra produjo su fruto.
Hermanos, si alguno de entre vosotros ha errado de la verdad, y alguno le convirtiere,
Sepa que el que hubiere hecho convertir al pecador del error de su camino, salvará un alma de muerte, y cubrirá multitud de pecados.
PEDRO, apóstol de Jesucristo, á los extranjeros esparcidos en Ponto, en Galacia, en Capadocia, en Asia, y en Bithinia,
Elegidos según la presciencia de Dios Padre en santificación del Espíritu, para obedecer y ser rociados con la sangre de Jesucristo: Gracia y paz os sea multiplicada.
Bendito el Dios y Padre de nuestro Señor Jesucristo, que según su grande misericordia nos ha regenerado en esperanza viva, por la resurrección de Jesucristo de los muertos,
Para una herencia incorruptible, y que no puede contaminarse, ni marchitarse, reservada en los cielos
Para nosotros que somos guardados en la virtud de Dios por fe, para alcanzar la salud que está aparejada para ser manifestada en el postrimero tiempo.
En lo cual vosotros os alegráis, estando al presente un poco de tiempo afligidos en diversas tentaciones, si es necesario,
Para que la prueba de vuestra fe, mucho más preciosa que el oro, el cual perece, bien que sea probado con fuego, sea hallada en alabanza, gloria y honra, cuando Jesucristo fuere manifestado:
Al cual, no habiendo visto, le amáis; en el cual creyendo, aunque al presente no lo veáis, os alegráis con gozo inefable y glorificado;
Obteniendo el fin de vuestra fe, que esla salud de vuestras almas.
De la cual salud los profetas que profetizaron de la gracia que había de venir á vosotros, han inquirido y diligentemente buscado,
Escudriñando cuándo y en qué punto de tiempo significaba el Espíritu de Cristo que estaba en ellos, el cual prenunciaba las aflicciones que habían de venir á Cristo, y las glorias después de ellas.
Por lo cual, teniendo los lomos de vuestro entendimiento ceñidos, con templanza, esperad perfectamente en la gracia que os es presentada cuando Jesucristo os es manifestado:
Como hijos obedientes, no conformándoos con los deseos que antes teníais estando en vuestra ignorancia;
Sino como aquel que os ha llamado es santo, sed también vosotros santos en toda conversación:
Porque escrito está: Sed santos, porque yo soy santo.
Y si invocáis por Padre á aquel que sin acepción de personas juzga según la obra de cada uno, conversad en temor todo el tiempo de vuestra peregrinación:
Sabiendo que habéis sido rescatados de vuestra vana conversación, la cual recibisteis de vuestros padres, no con cosas corruptibles, como oro ó plata;
Sino con la sangre preciosa de Cristo, como de un cordero sin mancha y sin contaminación:
Ya ordenado de antes de la fundación del mundo, pero manifestado en los postrimeros tiempos por amor de vosotros,
Que por él creéis á Dios, el cual le resucitó de los muertos, y le ha dado gloria, para que vuestra fe y esperanza sea en Dios.
Habiendo purificado vuestra almas en la obediencia de la verdad, por el Espíritu, en caridad hermanable sin fingimiento, amaos unos á otros entrañablemente de corazón puro:
Siendo renacidos, no de simiente corruptible, sino de incorruptible, por la palabra de Dios, que vive y permanece para siempre.
Porque Toda carne es como la hierba, y toda la gloria del hombre como la flor de la hierba: secóse la hierba, y la flor se cayó;
Mas la palabra del Señor permanece perpetuamente. Y esta es la palabra que por el evangelio os ha sido anunciada.
DEJANDO pues toda malicia, y todo engaño, y fingimientos, y envidias, y todas las detracciones,
Desead, como niños recién nacidos, la leche espiritual, sin engaño, para que por ella crezcáis en salud:
Si empero habéis gustado que el Señor es benigno;
Al cual allegándoos, piedra viva, reprobada cierto de los hombres, empero elegida de Dios, preciosa,
Vosotros también, como piedras vivas, sed edificados una casa espiritual, y un sacerdocio santo, para ofrecer sacrificios espirituales, agradables á Dios por Jesucristo.
Por lo cual también contiene la Escritura: He aquí, pongo en Sión la principal piedra del ángulo, escogida, preciosa; y el que creyere en ella, no será confundido.
Ellaes pues honor á vosotros que creéis: mas para los desobedientes, la piedra que los edificadores reprobaron, ésta fué hecha la cabeza del ángulo;
Y Piedra de tropiezo, y roca de escándalo á aquellos que tropiezan en la palabra, siendo desobedientes; para lo cual fueron también ordenados.
Mas vosotros sois linaje escogido, real sacerdocio, gente santa, pueblo adquirido, para que anunciéis las virtudes de aquel que os ha llamado de las tinieblas á su luz admirable:
Vosotros, que en el tiempo pasado no erais pueblo, mas ahora sois pueblo de Dios; que en el tiempo pasado no habíais alcanzado misericordia, mas ahora habéis alcanzado misericordia.
Amados, yo os ruego como á extranjeros y peregrinos, os abstengáis de los deseos carnales que batallan contra el alma,
Sed pues sujetos á toda ordenación humana por respeto á Dios: ya sea al rey, como á superior;
Ya á los gobernadores, como de él enviados para venganza de los malhechores, y para loor de los que hacen bien.
Porque esta es la voluntad de Dios; que haciendo bien, hagáis callar la ignorancia de los hombres vanos:
Como libres, y no como teniendo la libertad por cobertura de malicia, sino como siervos de Dios.
Honrad á todos. Amad la fraternidad. Temed á Dios. Honrad al rey.
Siervos, sed sujetos con todo temor á vuestros amos; no solamente á los buenos y humanos, sino también á los rigurosos.
Porque esto es agradable, si alguno á causa de la conciencia delante de Dios, sufre molestias padeciendo injustamente.
Porque ¿qué gloria es, si pecando vosotros sois abofeteados, y lo sufrís? mas si haciendo bien sois afligidos, y lo sufrís, esto ciertamente es agradable delante de Dios.
Porque para esto sois llamados; pues que también Cristo padeció por nosotros, dejándonos ejemplo, para que vosotros sigáis sus pisadas:
El cual no hizo pecado; ni fué hallado engaño en su boca:
Quien cuando le maldecían, no retornaba maldición; cuando padecía, no amenazaba, sino remitía la causa al que juzga justamente:
El cual mismo llevó nuestros pecados en su cuerpo sobre el madero, para que nosotros siendo muertos á los pecados, vivamos á la justicia: por la herida del cual habéis sido sanados.
Porque vosotros erais como ovejas descarriadas; mas ahora habéis vuelto al Pastor y Obispo de vuestras almas.
ASIMISMO vosotras, mujeres, sed sujetas á vuestros maridos; para que también los que no creen á la palabra, sean ganados sin palabra por la conversación de sus mujeres,
Considerando vuestra casta conversación, que es en temor.
El adorno de las cuales no sea exterior con encrespamiento del cabello, y atavío de oro, ni en compostura de ropas;
Sino el hombre del corazón que está encubierto, en incorruptible ornato de espíritu agradable y pacífico, lo cual es de grande estima delante de Dios.
Porque así también se ataviaban en el tiempo antiguo aquellas santas mujeres que esperaban en Dios, siendo sujetas á sus maridos:
Como Sara obedecía á Abraham, llamándole señor; de la cual vosotras sois hechas hijas, haciendo bien, y no sois espantadas de ningún pavor.
Y finalmente, sed todos de un mismo corazón, compasivos, amándoos fraternalmente, misericordiosos, amigables;
No volviendo mal por mal, ni maldición por maldición, sino antes por el contrario, bendiciendo; sabiendo que vosotros sois llamados para que poseáis bendición en herencia.
Porque el que quiere amar la vida, y ver días buenos, refrene su lengua de mal, y sus labios no hablen engaño;
Apártase del mal, y haga bien; busque la paz, y sígala.
Porque los ojos del Señor están sobre los justos, y sus oídos atentos á sus oraciones: pero el rostro del Señor está sobre aquellos que hacen mal.
¿Y quién es aquel que os podrá dañar, si vosotros seguís el bien?
Mas también si alguna cosa padecéis por hacer bien, sois bienaventurados. Por tanto, no temáis por el temor de ellos, ni seáis turbados;
Sino santificad al Señor Dios en vuestros corazones, y estad siempre aparejados para responder con mansedumbre y reverencia á cada uno que os demande razón de la esperanza que hay en vosotros:
Teniendo buena conciencia, para que en lo que murmuran de vosotros como de malhechores, sean confundidos los que blasfeman vuestra buena conversación en Cristo.
Porque mejor es que padezcáis haciendo bien, si la voluntad de Dios así lo quiere, que haciendo mal.
Porque también Cristo padeció una vez por los pecados, el justo por los injustos, para llevarnos á Dios, siendo á la verdad muerto en la carne, pero vivificado en espíritu;
En el cual también fué y predicó á los espíritus encarcelados;
El cual está á la diestra de Dios, habiendo subido al cielo; estando á él sujetos los ángeles, y las potestades, y virtudes.
PUES que Cristo ha padecido por nosotros en la carne, vosotros también estad armados del mismo pensamiento: que el que ha padecido en la carne, cesó de pecado;
Para que ya el tiempo que queda en carne, viva, no á las concupiscencias de los hombres, sino á la voluntad de Dios.
En lo cual les parece cosa extraña que vosotros no corráis con ellos en el mismo desenfrenamiento de disolución, ultrajándoos:
Los cuales darán cuenta al que está aparejado para juzgar los vivos y los muertos.
Porque por esto también ha sido predicado el evangelio á los muertos; para que sean juzgados en carne según los hombres, y vivan en espíritu según Dios.
Mas el fin de todas las cosas se acerca: sed pues templados, y velad en oración.
Y sobre todo, tened entre vosotros ferviente caridad; porque la caridad cubrirá multitud de pecados.
Hospedaos los unos á los otros sin murmuraciones.
Cada uno según el don que ha recibido, adminístrelo á los otros, como buenos dispensadores de las diferentes gracias de Dios.
Carísimos, no os maravilléis cuando sois examinados por fuego, lo cual se hace para vuestra prueba, como si alguna cosa peregrina os aconteciese;
Antes bien gozaos en que sois participantes de las aflicciones de Cristo; para que también en la revelación de su gloria os gocéis en triunfo.
Así que, ninguno de vosotros padezca como homicida, ó ladrón, ó malhechor, ó por meterse en negocios ajenos.
Pero si alguno padece como Cristiano, no se avergüence; antes glorifique á Dios en esta parte.
Porque es tiempo de que el juicio comience de la casa de Dios: y si primero comienza por nosotros, ¿qué será el fin de aquellos que no obedecen al evangelio de Dios?
Y si el justo con dificultad se salva, ¿á dónde aparecerá el infiel y el pecador?
Y por eso los que son afligidos según la voluntad de Dios, encomiéndenle sus almas, como á fiel Criador, haciendo bien.
RUEGO á los ancianos que están entre vosotros, yo ancianotambién con ellos, y testigo de las aflicciones de Cristo, que soy también participante de la gloria que ha de ser revelada:
Apacentad la grey de Dios que está entre vosotros, teniendo cuidado de ella, no por fuerza, sino voluntariamente; no por ganancia deshonesta, sino de un ánimo pronto;
Y no como teniendo señorío sobre las heredades del Señor, sino siendo dechados de la grey.
Y cuando apareciere el Príncipe de los pastores, vosotros recibiréis la corona incorruptible de gloria.
Igualmente, mancebos, sed sujetos á los ancianos; y todos sumisos unos á otros, revestíos de humildad; porque Dios resiste á los soberbios, y da gracia á los humildes.
Humillaos pues bajo la poderosa mano de Dios, para que él os ensalce cuando fuere tiempo;
Echando toda vuestra solicitud en él, porque él tiene cuidado de vosotros.
Sed templados, y velad; porque vuestro adversario el diablo, cual león rugiente, anda alrededor buscando á quien devore:
Al cual resistid firmes en la fe, sabiendo que las mismas aflicciones han de ser cumplidas en la compañía de vuestros hermanos que están en el mundo.
Mas el Dios de toda gracia, que nos ha llamado á su gloria eterna por Jesucristo, después que hubiereis un poco de tiempo padecido, él mismo os perfeccione, confirme, corrobore y establezca.
A él sea gloria é imperio para siempre. Amén.
Por Silvano, el hermano fiel, según yo pienso, os he escrito brevemente, amonestándoos, y testificando que ésta es la verdadera gracia de Dios, en la cual estáis.
La iglesia que está en Babilonia, juntamente elegida con vosotros, os saluda, y Marcos mi hijo.
Saludaos unos á otros con ósculo de caridad. Paz sea con todos vosotros los que estáis en Jesucristo. Amén.
SIMÓN Pedro, siervo y apóstol de Jesucristo, á los que habéis alcanzado fe igualmente preciosa con nosotros en la justicia de nuestro Dios y Salvador Jesucristo:
Gracia y paz os sea multiplicada en el conocimiento de Dios, y de nuestro Señor Jesús.
Como todas las cosas que pertenecen á la vida y á la piedad nos sean dadas de su divina potencia, por el conocimiento de aquel que nos ha llamado por su gloria y virtud:
Vosotros también, poniendo toda diligencia por esto mismo, mostrad en vuestra fe virtud, y en la virtud ciencia;
Y en la ciencia templanza, y en la templanza paciencia, y en la paciencia temor de Dios;
Y en el temor de Dios, amor fraternal, y en el amor fraternal caridad.
Porque si en vosotros hay estas cosas, y abundan, no os dejarán estar ociosos, ni estériles en el conocimiento de nuestro Señor Jesucristo.
Mas el que no tiene estas cosas, es ciego, y tiene la vista muy corta, habiendo olvidado la purificación de sus antiguos pecados.
Por lo cual, hermanos, procurad tanto más de hacer firme vuestra vocación y elección; porque haciendo estas cosas, no caeréis jamás.
Porque de esta manera os será abundantemente administrada la entrada en el reino eterno de nuestro Señor y Salvador Jesucristo.
Por esto, yo no dejaré de amonestaros siempre de estas cosas, aunque vosotros las sepáis, y estéis confirmados en la verdad presente.
Porque tengo por justo, en tanto que estoy en este tabernáculo, de incitaros con amonestación:
Sabiendo que brevemente tengo de dejar mi tabernáculo, como nuestro Señor Jesucristo me ha declarado.
También yo procuraré con diligencia, que después de mi fallecimiento, vosotros podáis siempre tener memoria de estas cosas.
Porque no os hemos dado á conocer la potencia y la venida de nuestro Señor Jesucristo, siguiendo fábulas por arte compuestas; sino como habiendo con nuestros propios ojos visto su majestad.
Porque él había recibido de Dios Padre honra y gloria, cuando una tal voz fué á él enviada de la magnífica gloria: Este es el amado Hijo mío, en el cual yo me he agradado.
Y nosotros oímos esta voz enviada del cielo, cuando estábamos juntamente con él en el monte santo.
Entendiendo primero esto, que ninguna profecía de la Escritura es de particular interpretación;
Porque la profecía no fué en los tiempos pasados traída por voluntad humana, sino los santos hombres de Dios hablaron siendo inspirados del Espíritu Santo.
Y muchos seguirán sus disoluciones, por los cuales el camino de la verdad será blasfemado;
Y por avaricia harán mercadería de vosotros con palabras fingidas; sobre los cuales la condenación ya de largo tiempo no se tarda, y su perdición no se duerme.
Porque si Dios no perdonó á los ángeles que habían pecado, sino que habiéndolos despeñado en el infierno con cadenas de oscuridad, los entregó para ser reservados al juicio;
Ysino perdonó al mundo viejo, mas guardó á Noé, pregonero de justicia, con otras siete personas, trayendo el diluvio sobre el mundo de malvados;
Ysicondenó por destrucción las ciudades de Sodoma y de Gomorra, tornándolas en ceniza, y poniéndolas por ejemplo á los que habían de vivir sin temor y reverencia de Dios;
Y libró al justo Lot, acosado por la nefanda conducta de los malvados;
(Porque este justo, con ver y oir, morando entre ellos, afligía cada día su alma justa con los hechos de aquellos injustos;)
Sabe el Señor librar de tentación á los píos, y reservar á los injustos para ser atormentados en el día del juicio;
Y principalmente á aquellos que, siguiendo la carne, andan en concupiscencia é inmundicia, y desprecian la potestad; atrevidos, contumaces, que no temen decir mal de las potestades superiores:
Como quiera que los mismos ángeles, que son mayores en fuerza y en potencia, no pronuncian juicio de maldición contra ellas delante del Señor.
Mas éstos, diciendo mal de las cosas que no entienden, como bestias brutas, que naturalmente son hechas para presa y destrucción, perecerán en su perdición,
Teniendo los ojos llenos de adulterio, y no saben cesar de pecar; cebando las almas inconstantes; teniendo el corazón ejercitado en codicias, siendo hijos de maldición;
Que han dejado el camino derecho, y se han extraviado, siguiendo el camino de Balaam, hijo de Bosor, el cual amó el premio de la maldad.
Y fué reprendido por su iniquidad: una muda bestia de carga, hablando en voz de hombre, refrenó la locura del profeta.
Estos son fuentes sin agua, y nubes traídas de torbellino de viento: para los cuales está guardada la oscuridad de las tinieblas para siempre.
Porque hablando arrogantes palabras de vanidad, ceban con las concupiscencias de la carne en disoluciones á los que verdaderamente habían huído de los que conversan en error;
Prometiéndoles libertad, siendo ellos mismos siervos de corrupción. Porque el que es de alguno vencido, es sujeto á la servidumbre del que lo venció.
Porque mejor les hubiera sido no haber conocido el camino de la justicia, que después de haberlo conocido, tornarse atrás del santo mandamiento que les fué dado.
Pero les ha acontecido lo del verdadero proverbio: El perro se volvió á su vómito, y la puerca lavada á revolcarse en el cieno.
CARÍSIMOS, yo os escribo ahora esta segunda carta, por las cualesambasdespierto con exhortación vuestro limpio entendimiento;
Para que tengáis memoria de las palabras que antes han sido dichas por los santos profetas, y de nuestro mandamiento, que somosapóstoles del Señor y Salvador:
Sabiendo primero esto, que en los postrimeros días vendrán burladores, andando según sus propias concupiscencias,
Y diciendo: ¿Dónde está la promesa de su advenimiento? porque desde el día en que los padres durmieron, todas las cosas permanecen así como desde el principio de la creación.
Cierto ellos ignoran voluntariamente, que los cielos fueron en el tiempo antiguo, y la tierra que por agua y en agua está asentada, por la palabra de Dios;
Por lo cual el mundo de entonces pereció anegado en agua:
Mas los cielos que son ahora, y la tierra, son conservados por la misma palabra, guardados para el fuego en el día del juicio, y de la perdición de los hombres impíos.
Mas, oh amados, no ignoréis esta una cosa: que un día delante del Señor es como mil años y mil años como un día.
El Señor no tarda su promesa, como algunos la tienen por tardanza; sino que es paciente para con nosotros, no queriendo que ninguno perezca, sino que todos procedan al arrepentimiento.
Pues como todas estas cosas han de ser deshechas, ¿qué tales conviene que vosotros seáis en santas y pías conversaciones,
Esperando y apresurándoos para la venida del día de Dios, en el cual los cielos siendo encendidos serán deshechos, y los elementos siendo abrasados, se fundirán?
Bien que esperamos cielos nuevos y tierra nueva, según sus promesas, en los cuales mora la justicia.
Por lo cual, oh amados, estando en esperanza de estas cosas, procurad con diligencia que seáis hallados de él sin mácula, y sin reprensión, en paz.
Y tened por salud la paciencia de nuestro Señor; como también nuestro amado hermano Pablo, según la sabiduría que le ha sido dada, os ha escrito también;
Así que vosotros, oh amados, pues estáis amonestados, guardaos que por el error de los abominables no seáis juntamente extraviados, y caigáis de vuestra firmeza.
Mas creced en la gracia y conocimiento de nuestro Señor y Salvador Jesucristo. A él sea gloria ahora y hasta el día de la eternidad. Amén.
LO que era desde el principio, lo que hemos oído, lo que hemos visto con nuestros ojos, lo que hemos mirado, y palparon nuestras manos tocante al Verbo de vida;
(Porque la vida fué manifestada, y vimos, y testificamos, y os anunciamos aquella vida eterna, la cual estaba con el Padre, y nos ha aparecido;)
Lo que hemos visto y oído, eso os anunciamos, para que también vosotros tengáis comunión con nosotros: y nuestra comunión verdaderamente es con el Padre, y con su Hijo Jesucristo.
Y estas cosas os escribimos, para que vuestro gozo sea cumplido.
Y este es el mensaje que oímos de él, y os anunciamos: Que Dios es luz, y en él no hay ningunas tinieblas.
Si nosotros dijéremos que tenemos comunión con él, y andamos en tinieblas, mentimos, y no hacemos la verdad;
Mas si andamos en luz, como él está en luz, tenemos comunión entre nosotros, y la sangre de Jesucristo su Hijo nos limpia de todo pecado.
Si dijéremos que no tenemos pecado, nos engañamos á nosotros mismos, y no hay verdad en nosotros.
Si confesamos nuestros pecados, él es fiel y justo para que nos perdone nuestros pecados, y nos limpie de toda maldad.
Si dijéremos que no hemos pecado, lo hacemos á él mentiroso, y su palabra no está en nosotros.
HIJITOS míos, estas cosas os escribo, para que no pequéis; y si alguno hubiere pecado, abogado tenemos para con el Padre, á Jesucristo el justo;
Y él es la propiciación por nuestros pecados: y no solamente por los nuestros, sino también por los de todo el mundo.
Y en esto sabemos que nosotros le hemos conocido, si guardamos sus mandamientos.
El que dice, Yo le he conocido, y no guarda sus mandamientos, el tal es mentiroso, y no hay verdad en él;
Mas el que guarda su palabra, la caridad de Dios está verdaderamente perfecta en él: por esto sabemos que estamos en él.
El que dice que está en él, debe andar como él anduvo.
Hermanos, no os escribo mandamiento nuevo, sino el mandamiento antiguo que habéis tenido desde el principio: el mandamiento antiguo es la palabra que habéis oído desde el principio.
Otra vez os escribo un mandamiento nuevo, que es verdadero en él y en vosotros; porque las tinieblas son pasadas, y la verdadera luz ya alumbra.
El que dice que está en luz, y aborrece á su hermano, el tal aun está en tinieblas todavía.
El que ama á su hermano, está en luz, y no hay tropiezo en él.
Mas el que aborrece á su hermano, está en tinieblas, y anda en tinieblas, y no sabe á donde va; porque las tinieblas le han cegado los ojos.
Os escribo á vosotros, hijitos, porque vuestros pecados os son perdonados por su nombre.
No améis al mundo, ni las cosas que están en el mundo. Si alguno ama al mundo, el amor del Padre no está en él.
Porque todo lo que hay en el mundo, la concupiscencia de la carne, y la concupiscencia de los ojos, y la soberbia de la vida, no es del Padre, mas es del mundo.
Y el mundo se pasa, y su concupiscencia; mas el que hace la voluntad de Dios, permanece para siempre.
Hijitos, yaes el último tiempo: y como vosotros habéis oído que el anticristo ha de venir, así también al presente han comenzado á ser muchos anticristos; por lo cual sabemos que es el último tiempo.
Salieron de nosotros, mas no eran de nosotros; porque si fueran de nosotros, hubieran cierto permanecido con nosotros; perosalieronpara que se manifestase que todos no son de nosotros.
Mas vosotros tenéis la unción del Santo, y conocéis todas las cosas.
No os he escrito como si ignoraseis la verdad, sino como á los que la conocéis, y que ninguna mentira es de la verdad.
¿Quién es mentiroso, sino el que niega que Jesús es el Cristo? Este tal es anticristo, que niega al Padre y al Hijo.
Cualquiera que niega al Hijo, este tal tampoco tiene al Padre. Cualquiera que confiese al Hijo tiene también al Padre.
Y esta es la promesa, la cual él nos prometió, la vida eterna.
Os he escrito esto sobre los que os engañan.
Y ahora, hijitos, perseverad en él; para que cuando apareciere, tengamos confianza, y no seamos confundidos de él en su venida.
Si sabéis que él es justo, sabed también que cualquiera que hace justicia, es nacido de él.
MIRAD cuál amor nos ha dado el Padre, que seamos llamados hijos de Dios: por esto el mundo no nos conoce, porque no le conoce á él.
Muy amados, ahora somos hijos de Dios, y aun no se ha manifestado lo que hemos de ser; pero sabemos que cuando él apareciere, seremos semejantes á él, porque le veremos como él es.
Y cualquiera que tiene esta esperanza en él, se purifica, como él también es limpio.
Cualquiera que hace pecado, traspasa también la ley; pues el pecado es transgresión de la ley.
Y sabéis que él apareció para quitar nuestros pecados, y no hay pecado en él.
Cualquiera que permanece en él, no peca; cualquiera que peca, no le ha visto, ni le ha conocido.
Hijitos, no os engañe ninguno: el que hace justicia, es justo, como él también es justo.
El que hace pecado, es del diablo; porque el diablo peca desde el principio. Para esto apareció el Hijo de Dios, para deshacer las obras del diablo.
Cualquiera que es nacido de Dios, no hace pecado, porque su simiente está en él; y no puede pecar, porque es nacido de Dios.
En esto son manifiestos los hijos de Dios, y los hijos del diablo: cualquiera que no hace justicia, y que no ama á su hermano, no es de Dios.
Porque este es el mensaje que habéis oído desde el principio: Que nos amemos unos á otros.
No como Caín, que era del maligno, y mató á su hermano. ¿Y por qué causa le mató? Porque sus obras eran malas, y las de su hermano justas.
Hermanos míos, no os maravilléis si el mundo os aborrece.
Nosotros sabemos que hemos pasado de muerte á vida, en que amamos á los hermanos. El que no ama á su hermano, está en muerte.
Cualquiera que aborrece á su hermano, es homicida; y sabéis que ningún homicida tiene vida eterna permaneciente en sí.
En esto hemos conocido el amor, porque él puso su vida por nosotros: también nosotros debemos poner nuestras vidas por los hermanos.
Mas el que tuviere bienes de este mundo, y viere á su hermano tener necesidad, y le cerrare sus entrañas, ¿cómo está el amor de Dios en él?
Hijitos míos, no amemos de palabra ni de lengua, sino de obra y en verdad.
Y en esto conocemos que somos de la verdad, y tenemos nuestros corazones certificados delante de él.
Porque si nuestro corazón nos reprendiere, mayor es Dios que nuestro corazón, y conoce todas las cosas.
Carísimos, si nuestro corazón no nos reprende, confianza tenemos en Dios;
Y cualquier cosa que pidiéremos, la recibiremos de él, porque guardamos sus mandamientos, y hacemos las cosas que son agradables delante de él.
Y éste es su mandamiento: Que creamos en el nombre de su Hijo Jesucristo, y nos amemos unos á otros como nos lo ha mandado.
Y el que guarda sus mandamientos, está en él, y él en él. Y en esto sabemos que él permanece en nosotros, por el Espíritu que nos ha dado.
AMADOS, no creáis á todo espíritu, sino probad los espíritus si son de Dios: porque muchos falsos profetas son salidos en el mundo.
En esto conoced el Espíritu de Dios: todo espíritu que confiesa que Jesucristo es venido en carne es de Dios:
Hijitos, vosotros sois de Dios, y los habéis vencido; porque el que en vosotros está, es mayor que el que está en el mundo.
Ellos son del mundo; por eso hablan del mundo, y el mundo los oye.
Nosotros somos de Dios: el que conoce á Dios, nos oye: el que no es de Dios, no nos oye. Por esto conocemos el espíritu de verdad y el espíritu de error.
Carísimos, amémonos unos á otros; porque el amor es de Dios. Cualquiera que ama, es nacido de Dios, y conoce á Dios.
El que no ama, no conoce á Dios; porque Dios es amor.
En esto se mostró el amor de Dios para con nosotros, en que Dios envió á su Hijo unigénito al mundo, para que vivamos por él.
En esto consiste el amor: no que nosotros hayamos amado á Dios, sino que él nos amó á nosotros, y ha enviado á su Hijo en propiciación por nuestros pecados.
Amados, si Dios así nos ha amado, debemos también nosotros amarnos unos á otros.
Ninguno vió jamás á Dios. Si nos amamos unos á otros, Dios está en nosotros, y su amor es perfecto en nosotros:
En esto conocemos que estamos en él, y él en nosotros, en que nos ha dado de su Espíritu.
Y nosotros hemos visto y testificamos que el Padre ha enviado al Hijo para ser Salvador del mundo.
Cualquiera que confesare que Jesús es el Hijo de Dios, Dios está en él, y él en Dios.
Y nosotros hemos conocido y creído el amor que Dios tiene para con nosotros. Dios es amor; y el que vive en amor, vive en Dios, y Dios en él.
En esto es perfecto el amor con nosotros, para que tengamos confianza en el día del juicio; pues como él es, así somos nosotros en este mundo.
En amor no hay temor; mas el perfecto amor echa fuera el temor: porque el temor tiene pena. De donde el que teme, no está perfecto en el amor.
Nosotros le amamos á él, porque él nos amó primero.
Si alguno dice, Yo amo á Dios, y aborrece á su hermano, es mentiroso. Porque el que no ama á su hermano al cual ha visto, ¿cómo puede amar á Dios á quien no ha visto?
Y nosotros tenemos este mandamiento de él: Que el que ama á Dios, ame también á su hermano.
TODO aquel que cree que Jesús es el Cristo, es nacido de Dios: y cualquiera que ama al que ha engendrado, ama también al que es nacido de él.
En esto conocemos que amamos á los hijos de Dios, cuando amamos á Dios, y guardamos sus mandamientos.
Porque este es el amor de Dios, que guardemos sus mandamientos; y sus mandamientos no son penosos.
Porque todo aquello que es nacido de Dios vence al mundo: y esta es la victoria que vence al mundo, nuestra fe.
¿Quién es el que vence al mundo, sino el que cree que Jesús es el Hijo de Dios?
Este es Jesucristo, que vino por agua y sangre: no por agua solamente, sino por agua y sangre. Y el Espíritu es el que da testimonio: porque el Espíritu es la verdad.
Y tres son los que dan testimonio en la tierra, el Espíritu, y el agua, y la sangre: y estos tres concuerdan en uno.
Si recibimos el testimonio de los hombres, el testimonio de Dios es mayor; porque éste es el testimonio de Dios, que ha testificado de su Hijo.
El que cree en el Hijo de Dios, tiene el testimonio en sí mismo: el que no cree á Dios, le ha hecho mentiroso; porque no ha creído en el testimonio que Dios ha testificado de su Hijo.
Y este es el testimonio: Que Dios nos ha dado vida eterna; y esta vida está en su Hijo.
El que tiene al Hijo, tiene la vida: el que no tiene al Hijo de Dios, no tiene la vida.
Estas cosas he escrito á vosotros que creéis en el nombre del Hijo de Dios, para que sepáis que tenéis vida eterna, y para que creáis en el nombre del Hijo de Dios.
Y esta es la confianza que tenemos en él, que si demandáremos alguna cosa conforme á su voluntad, él nos oye.
Y si sabemos que él nos oye en cualquiera cosa que demandáremos, sabemos que tenemos las peticiones que le hubiéremos demandado.
Toda maldad es pecado; mas hay pecado no de muerte.
Sabemos que cualquiera que es nacido de Dios, no peca; mas el que es engendrado de Dios, se guarda á sí mismo, y el maligno no le toca.
Sabemos que somos de Dios, y todo el mundo está puesto en maldad.
Hijitos, guardaos de los ídolos. Amén.
EL anciano á la señora elegida y á sus hijos, á los cuales yo amo en verdad; y no yo solo, sino también todos los que han conocido la verdad,
Por la verdad que está en nosotros, y será perpetuamente con nosotros:
Sea con vosotros gracia, misericordia, y paz de Dios Padre, y del Señor Jesucristo, Hijo del Padre, en verdad y en amor.
Mucho me he gozado, porque he hallado de tus hijos, que andan en verdad, como nosotros hemos recibido el mandamiento del Padre.
Y ahora te ruego, señora, no como escribiéndote un nuevo mandamiento, sino aquel que nosotros hemos tenido desde el principio, que nos amemos unos á otros.
Y este es amor, que andemos según sus mandamientos. Este es el mandamiento: Que andéis en él, como vosotros habéis oído desde el principio.
Porque muchos engañadores son entrados en el mundo, los cuales no confiesan que Jesucristo ha venido en carne. Este tal el engañador es, y el anticristo.
Mirad por vosotros mismos, porque no perdamos las cosas que hemos obrado, sino que recibamos galardón cumplido.
Cualquiera que se rebela, y no persevera en la doctrina de Cristo, no tiene á Dios: el que persevera en la doctrina de Cristo, el tal tiene al Padre y al Hijo.
Si alguno viene á vosotros, y no trae esta doctrina, no lo recibáis en casa, ni le digáis: ¡bienvenido!
Porque el que le dice bienvenido, comunica con sus malas obras.
Aunque tengo muchas cosas que escribiros, no he querido comunicarlas por medio de papel y tinta; mas espero ir á vosotros, y hablar boca á boca, para que nuestro gozo sea cumplido.
Los hijos de tu hermana elegida te saludan. Amén.
EL anciano al muy amado Gaio, al cual yo amo en verdad.
Amado, yo deseo que tú seas prosperado en todas cosas, y que tengas salud, así como tu alma está en prosperidad.
Ciertamente me gocé mucho cuando vinieron los hermanos y dieron testimonio de tu verdad, así como tú andas en la verdad.
No tengo yo mayor gozo que éste, el oir que mis hijos andan en la verdad.
Amado, fielmente haces todo lo que haces para con los hermanos, y con los extranjeros,
Los cuales han dado testimonio de tu amor en presencia de la iglesia: á los cuales si ayudares como conviene según Dios, harás bien.
Porque ellos partieron por amor de su nombre, no tomando nada de los Gentiles.
Nosotros, pues, debemos recibir á los tales, para que seamos cooperadores á la verdad.
Yo he escrito á la iglesia: mas Diótrefes, que ama tener el primado entre ellos, no nos recibe.
Amado, no sigas lo que es malo, sino lo que es bueno. El que hace bien es de Dios: mas el que hace mal, no ha visto á Dios.
Todos dan testimonio de Demetrio, y aun la misma verdad: y también nosotros damos testimonio; y vosotros habéis conocido que nuestro testimonio es verdadero.
Yo tenía muchas cosas que escribirte; empero no quiero escribirte por tinta y pluma:
Porque espero verte en breve, y hablaremos boca á boca. Paz sea contigo. Los amigos te saludan. Saluda tú á los amigos por nombre.
JUDAS, siervo de Jesucristo, y hermano de Jacobo, á los llamados, santificados en Dios Padre, y conservados en Jesucristo:
Misericordia, y paz, y amor os sean multiplicados.
Os quiero pues amonestar, ya que alguna vez habéis sabido esto, que el Señor habiendo salvado al pueblo de Egipto, después destruyó á los que no creían:
Y á los ángeles que no guardaron su dignidad, mas dejaron su habitación, los ha reservado debajo de oscuridad en prisiones eternas hasta el juicio del gran día:
De la misma manera también estos soñadores amancillan la carne, y menosprecian la potestad, y vituperan las potestades superiores.
Pero cuando el arcángel Miguel contendía con el diablo, disputando sobre el cuerpo de Moisés, no se atrevió á usar de juicio de maldición contra él, sino que dijo: El Señor te reprenda.
Pero éstos maldicen las cosas que no conocen; y las cosas que naturalmente conocen, se corrompen en ellas, como bestias brutas.
¡Ay de ellos! porque han seguido el camino de Caín, y se lanzaron en el error de Balaam por recompensa, y perecieron en la contradicción de Coré.
Fieras ondas de la mar, que espuman sus mismas abominaciones; estrellas erráticas, á las cuales es reservada eternalmente la oscuridad de las tinieblas.
De los cuales también profetizó Enoc, séptimo desde Adam, diciendo: He aquí, el Señor es venido con sus santos millares,
Estos son murmuradores, querellosos, andando según sus deseos; y su boca habla cosas soberbias, teniendo en admiración las personas por causa del provecho.
Mas vosotros, amados, tened memoria de las palabras que antes han sido dichas por los apóstoles de nuestro Señor Jesucristo;
Como os decían: Que en el postrer tiempo habría burladores, que andarían según sus malvados deseos.
Estos son los que hacen divisiones, sensuales, no teniendo el Espíritu.
Mas vosotros, oh amados, edificándoos sobre vuestra santísima fe, orando por el Espíritu Santo,
Conservaos en el amor de Dios, esperando la misericordia de nuestro Señor Jesucristo, para vida eterna.
Y recibid á los unos en piedad, discerniendo:
Mas haced salvos á los otros por temor, arrebatándolos del fuego; aborreciendo aun la ropa que es contaminada de la carne.
A aquel, pues, que es poderoso para guardaros sin caída, y presentaros delante de su gloria irreprensibles, con grande alegría,
Al Dios solo sabio, nuestro Salvador, sea gloria y magnificencia, imperio y potencia, ahora y en todos los siglos. Amén.
LA revelación de Jesucristo, que Dios le dió, para manifestar á sus siervos las cosas que deben suceder presto; yladeclaró, enviándolapor su ángel á Juan su siervo,
El cual ha dado testimonio de la palabra de Dios, y del testimonio de Jesucristo, y de todas las cosas que ha visto.
Bienaventurado el que lee, y los que oyen las palabras de esta profecía, y guardan las cosas en ella escritas: porque el tiempo está cerca.
Juan á las siete iglesias que están en Asia: Graciaseacon vosotros, y paz del que es y que era y que ha de venir, y de los siete Espíritus que están delante de su trono;
Y de Jesucristo, el testigo fiel, el primogénito de los muertos, y príncipe de los reyes de la tierra. Al que nos amó, y nos ha lavado de nuestros pecados con su sangre,
Y nos ha hecho reyes y sacerdotes para Dios y su Padre; á élseagloria é imperio para siempre jamás. Amén.
He aquí que viene con las nubes, y todo ojo le verá, y los que le traspasaron; y todos los linajes de la tierra se lamentarán sobre él. Así sea. Amén.
Yo soy el Alpha y la Omega, principio y fin, dice el Señor, que es y que era y que ha de venir, el Todopoderoso.
Yo fuí en el Espíritu en el día del Señor, y oí detrás de mí una gran voz como de trompeta,
Y me volví á ver la voz que hablaba conmigo: y vuelto, vi siete candeleros de oro;
Y en medio de los siete candeleros, uno semejante al Hijo del hombre, vestido de una ropa que llegaba hasta los pies, y ceñido por los pechos con una cinta de oro.
Y su cabeza y sus cabellos eran blancos como la lana blanca, como la nieve; y sus ojos como llama de fuego;
Y sus pies semejantes al latón fino, ardientes como en un horno; y su voz como ruido de muchas aguas.
Y tenía en su diestra siete estrellas: y de su boca salía una espada aguda de dos filos. Y su rostro era como el sol cuando resplandece en su fuerza.
Y cuando yo le vi, caí como muerto á sus pies. Y él puso su diestra sobre mí, diciéndome: No temas: yo soy el primero y el último;
Y el que vivo, y he sido muerto; y he aquí que vivo por siglos de siglos, Amén. Y tengo las llaves del infierno y de la muerte:
Escribe las cosas que has visto, y las que son, y las que han de ser después de éstas:
ESCRIBE al ángel de la iglesia en EFESO: El que tiene las siete estrellas en su diestra, el cual anda en medio de los siete candeleros de oro, dice estas cosas:
Yo sé tus obras, y tu trabajo y paciencia; y que tú no puedes sufrir los malos, y has probado á los que se dicen ser apóstoles, y no lo son, y los has hallado mentirosos;
Y has sufrido, y has tenido paciencia, y has trabajado por mi nombre, y no has desfallecido.
Pero tengo contra ti que has dejado tu primer amor.
Recuerda por tanto de dónde has caído, y arrepiéntete, y haz las primeras obras; pues si no, vendré presto á ti, y quitaré tu candelero de su lugar, si no te hubieres arrepentido.
Mas tienes esto, que aborreces los hechos de los Nicolaítas; los cuales yo también aborrezco.
El que tiene oído, oiga lo que el Espíritu dice á las iglesias. Al que venciere, daré á comer del árbol de la vida, el cual está en medio del paraíso de Dios.
Y escribe al ángel de la iglesia en SMIRNA: El primero y postrero, que fué muerto, y vivió, dice estas cosas:
Yo sé tus obras, y tu tribulación, y tu pobreza (pero tú eres rico), y la blasfemia de los que se dicen ser Judíos, y no lo son, mas son sinagoga de Satanás.
El que tiene oído, oiga lo que el Espíritu dice á las iglesias. El que venciere, no recibirá daño de la muerte segunda.
Y escribe al ángel de la iglesia en PÉRGAMO: El que tiene la espada aguda de dos filos, dice estas cosas:
Así también tú tienes á los que tienen la doctrina de los Nicolaítas, lo cual yo aborrezco.
Arrepiéntete, porque de otra manera vendré á ti presto, y pelearé contra ellos con la espada de mi boca.
Y escribe al ángel de la iglesia en TIATIRA: El Hijo de Dios, que tiene sus ojos como llama de fuego, y sus pies semejantes al latón fino, dice estas cosas:
Yo he conocido tus obras, y caridad, y servicio, y fe, y tu paciencia, y que tus obras postreras son más que las primeras.
Y le he dado tiempo para que se arrepienta de la fornicación; y no se ha arrepentido.
He aquí, yo la echo en cama, y á los que adulteran con ella, en muy grande tribulación, si no se arrepintieren de sus obras:
Y mataré á sus hijos con muerte; y todas las iglesias sabrán que yo soy el que escudriño los riñones y los corazones: y daré á cada uno de vosotros según sus obras.
Empero la que tenéis, tenedla hasta que yo venga.
Y al que hubiere vencido, y hubiere guardado mis obras hasta el fin, yo le daré potestad sobre las gentes;
Y las regirá con vara de hierro, y serán quebrantados como vaso de alfarero, como también yo he recibido de mi Padre:
Y le daré la estrella de la mañana.
El que tiene oído, oiga lo que el Espíritu dice á las iglesias.
Sé vigilante y confirma las otras cosas que están para morir; porque no he hallado tus obras perfectas delante de Dios.
Acuérdate pues de lo que has recibido y has oído, y guárdalo, y arrepiéntete. Y si no velares, vendré á ti como ladrón, y no sabrás en qué hora vendré á ti.
Mas tienes unas pocas personas en Sardis que no han ensuciado sus vestiduras: y andarán conmigo en vestiduras blancas; porque son dignos.
El que venciere, será vestido de vestiduras blancas; y no borraré su nombre del libro de la vida, y confesaré su nombre delante de mi Padre, y delante de sus ángeles.
El que tiene oído, oiga lo que el Espíritu dice á las iglesias.
Y escribe al ángel de la iglesia en FILADELFIA: Estas cosas dice el Santo, el Verdadero, el que tiene la llave de David, el que abre y ninguno cierra, y cierra y ninguno abre:
Yo conozco tus obras: he aquí, he dado una puerta abierta delante de ti, la cual ninguno puede cerrar; porque tienes un poco de potencia, y has guardado mi palabra, y no has negado mi nombre.
Porque has guardado la palabra de mi paciencia, yo también te guardaré de la hora de la tentación que ha de venir en todo el mundo, para probar á los que moran en la tierra.
He aquí, yo vengo presto; retén lo que tienes, para que ninguno tome tu corona.
El que tiene oído, oiga lo que el Espíritu dice á las iglesias.
Y escribe al ángel de la iglesia en LAODICEA: He aquí dice el Amén, el testigo fiel y verdadero, el principio de la creación de Dios:
Yo conozco tus obras, que ni eres frío, ni caliente. ¡Ojalá fueses frío, ó caliente!
Mas porque eres tibio, y no frío ni caliente, te vomitaré de mi boca.
Porque tú dices: Yo soy rico, y estoy enriquecido, y no tengo necesidad de ninguna cosa; y no conoces que tú eres un cuitado y miserable y pobre y ciego y desnudo;
Yo reprendo y castigo á todos los que amo: sé pues celoso, y arrepiéntete.
He aquí, yo estoy á la puerta y llamo: si alguno oyere mi voz y abriere la puerta, entraré á él, y cenaré con él, y él conmigo.
Al que venciere, yo le daré que se siente conmigo en mi trono; así como yo he vencido, y me he sentado con mi Padre en su trono.
El que tiene oído, oiga lo que el Espíritu dice á las iglesias.
Y luego yo fuí en Espíritu: y he aquí, un trono que estaba puesto en el cielo, y sobre el trono estaba uno sentado.
Y el que estaba sentado, era al parecer semejante á una piedra de jaspe y de sardio: y un arco celestehabíaalrededor del trono, semejante en el aspecto á la esmeralda.
Y alrededor del trono había veinticuatro sillas: y vi sobre las sillas veinticuatro ancianos sentados, vestidos de ropas blancas; y tenían sobre sus cabezas coronas de oro.
Y del trono salían relámpagos y truenos y voces: y siete lámparas de fuego estaban ardiendo delante del trono, las cuales son los siete Espíritus de Dios.
Y delante del tronohabíacomo un mar de vidrio semejante al cristal; y en medio del trono, y alrededor del trono, cuatro animales llenos de ojos delante y detrás.
Y el primer animalerasemejante á un león; y el segundo animal, semejante á un becerro; y el tercer animal tenía la cara como de hombre; y el cuarto animal, semejante á un águila volando.
Y cuando aquellos animales daban gloria y honra y alabanza al que estaba sentado en el trono, al que vive para siempre jamás,
Los veinticuatro ancianos se postraban delante del que estaba sentado en el trono, y adoraban al que vive para siempre jamás, y echaban sus coronas delante del trono, diciendo:
Señor, digno eres de recibir gloria y honra y virtud: porque tú criaste todas las cosas, y por tu voluntad tienen ser y fueron criadas.
Y VI en la mano derecha del que estaba sentado sobre el trono un libro escrito de dentro y de fuera, sellado con siete sellos.
Y vi un fuerte ángel predicando en alta voz: ¿Quién es digno de abrir el libro, y de desatar sus sellos?
Y ninguno podía, ni en el cielo, ni en la tierra, ni debajo de la tierra, abrir el libro, ni mirarlo.
Y yo lloraba mucho, porque no había sido hallado ninguno digno de abrir el libro, ni de leerlo, ni de mirarlo.
Y uno de los ancianos me dice: No llores: he aquí el león de la tribu de Judá, la raíz de David, que ha vencido para abrir el libro, y desatar sus siete sellos.
Y él vino, y tomó el libro de la mano derecha de aquel que estaba sentado en el trono.
Y nos has hecho para nuestro Dios reyes y sacerdotes, y reinaremos sobre la tierra.
Y miré, y oí voz de muchos ángeles alrededor del trono, y de los animales, y de los ancianos; y la multitud de ellos era millones de millones,
Que decían en alta voz: El Cordero que fué inmolado es digno de tomar el poder y riquezas y sabiduría, y fortaleza y honra y gloria y alabanza.
Y los cuatro animales decían: Amén. Y los veinticuatro ancianos cayeron sobre sus rostros, y adoraron al que vive para siempre jamás.
Y MIRÉ cuando el Cordero abrió uno de los sellos, y oí á uno de los cuatro animales diciendo como con una voz de trueno: Ven y ve.
Y miré, y he aquí un caballo blanco: y el que estaba sentado encima de él, tenía un arco; y le fué dada una corona, y salió victorioso, para que también venciese.
Y cuando él abrió el segundo sello, oí al segundo animal, que decía: Ven y ve.
Y salió otro caballo bermejo: y al que estaba sentado sobre él, fué dado poder de quitar la paz de la tierra, y que se maten unos á otros: y fuéle dada una grande espada.
Y cuando él abrió el tercer sello, oí al tercer animal, que decía: Ven y ve. Y miré, y he aquí un caballo negro: y el que estaba sentado encima de él, tenía un peso en su mano.
Y oí una voz en medio de los cuatro animales, que decía: Dos libras de trigo por un denario, y seis libras de cebada por un denario: y no hagas daño al vino ni al aceite.
Y cuando él abrió el cuarto sello, oí la voz del cuarto animal, que decía: Ven y ve.
Y cuando él abrió el quinto sello, vi debajo del altar las almas de los que habían sido muertos por la palabra de Dios y por el testimonio que ellos tenían.
Y clamaban en alta voz diciendo: ¿Hasta cuándo, Señor, santo y verdadero, no juzgas y vengas nuestra sangre de los que moran en la tierra?
Y miré cuando él abrió el sexto sello, y he aquí fué hecho un gran terremoto; y el sol se puso negro como un saco de cilicio, y la luna se puso toda como sangre;
Y las estrellas del cielo cayeron sobre la tierra, como la higuera echa sus higos cuando es movida de gran viento.
Y el cielo se apartó como un libro que es envuelto; y todo monte y las islas fueron movidas de sus lugares.
Y los reyes de la tierra, y los príncipes, y los ricos, y los capitanes, y los fuertes, y todo siervo y todo libre, se escondieron en las cuevas y entre las peñas de los montes;
Y decían á los montes y á las peñas: Caed sobre nosotros, y escondednos de la cara de aquél que está sentado sobre el trono, y de la ira del Cordero:
Porque el gran día de su ira es venido; ¿y quién podrá estar firme?
Y vi otro ángel que subía del nacimiento del sol, teniendo el sello del Dios vivo: y clamó con gran voz á los cuatro ángeles, á los cuales era dado hacer daño á la tierra y á la mar,
Diciendo: No hagáis daño á la tierra, ni al mar, ni á los árboles, hasta que señalemos á los siervos de nuestro Dios en sus frentes.
Y oí el número de los señalados: ciento cuarenta y cuatro mil señalados de todas las tribus de los hijos de Israel.
De la tribu de Judá, doce mil señalados. De la tribu de Rubén, doce mil señalados. De la tribu de Gad, doce mil señalados.
De la tribu de Aser, doce mil señalados. De la tribu de Neftalí, doce mil señalados. De la tribu de Manasés, doce mil señalados.
De la tribu de Simeón, doce mil señalados. De la tribu de Leví, doce mil señalados. De la tribu de Issachâr, doce mil señalados.
De la tribu de Zabulón, doce mil señalados. De la tribu de José, doce mil señalados. De la tribu de Benjamín, doce mil señalados.
Y clamaban en alta voz, diciendo: Salvación á nuestro Dios que está sentado sobre el trono, y al Cordero.
Y todos los ángeles estaban alrededor del trono, y delos ancianos y los cuatro animales; y postráronse sobre sus rostros delante del trono, y adoraron á Dios,
Diciendo: Amén: La bendición y la gloria y la sabiduría, y la acción de gracias y la honra y la potencia y la fortaleza, seaná nuestro Dios para siempre jamás. Amén.
Y respondió uno de los ancianos, diciéndome: Estos que están vestidos de ropas blancas, ¿quiénes son, y de dónde han venido?
Y yo le dije: Señor, tú lo sabes. Y él me dijo: Estos son los que han venido de grande tribulación, y han lavado sus ropas, y las han blanqueado en la sangre del Cordero.
Por esto están delante del trono de Dios, y le sirven día y noche en su templo: y el que está sentado en el trono tenderá su pabellón sobre ellos.
No tendrán más hambre, ni sed, y el sol no caerá más sobre ellos, ni otro ningún calor.
Porque el Cordero que está en medio del trono los pastoreará, y los guiará á fuentes vivas de aguas: y Dios limpiará toda lágrima de los ojos de ellos.
Y CUANDO él abrió el séptimo sello, fué hecho silencio en el cielo casi por media hora.
Y vi los siete ángeles que estaban delante de Dios; y les fueron dadas siete trompetas.
Y el humo del incienso subió de la mano del ángel delante de Dios, con las oraciones de los santos.
Y el ángel tomó el incensario, y lo llenó del fuego del altar, y echólo en la tierra; y fueron hechos truenos y voces y relámpagos y terremotos.
Y los siete ángeles que tenían las siete trompetas, se aparejaron para tocar.
Y el segundo ángel tocó la trompeta, y como un grande monte ardiendo con fuego fué lanzado en la mar; y la tercera parte de la mar se tornó en sangre.
Y murió la tercera parte de las criaturas que estaban en la mar, las cuales tenían vida; y la tercera parte de los navíos pereció.
Y el tercer ángel tocó la trompeta, y cayó del cielo una grande estrella, ardiendo como una antorcha, y cayó en la tercera parte de los ríos, y en las fuentes de las aguas.
Y el nombre de la estrella se dice Ajenjo. Y la tercera parte de las aguas fué vuelta en ajenjo: y muchos hombres murieron por las aguas, porque fueron hechas amargas.
Y EL quinto ángel tocó la trompeta, y vi una estrella que cayó del cielo en la tierra; y le fué dada la llave del pozo del abismo.
Y abrió el pozo del abismo, y subió humo del pozo como el humo de un gran horno; y oscurecióse el sol y el aire por el humo del pozo.
Y del humo salieron langostas sobre la tierra; y fuéles dada potestad, como tienen potestad los escorpiones de la tierra.
Y les fué mandado que no hiciesen daño á la hierba de la tierra, ni á ninguna cosa verde, ni á ningún árbol, sino solamente á los hombres que no tienen la señal de Dios en sus frentes.
Y les fué dado que no los matasen, sino que los atormentasen cinco meses; y su tormento era como tormento de escorpión, cuando hiere al hombre.
Y en aquellos días buscarán los hombres la muerte, y no la hallarán; y desearán morir, y la muerte huirá de ellos.
Y el parecer de las langostas era semejante á caballos aparejados para la guerra: y sobre sus cabezasteníancomo coronas semejantes al oro; y sus caras como caras de hombres.
Y tenían cabellos como cabellos de mujeres: y sus dientes eran como dientes de leones.
Y tenían corazas como corazas de hierro; y el estruendo de sus alas, como el ruido de carros que con muchos caballos corren á la batalla.
Y tenían colas semejantes á las de los escorpiones, y tenían en sus colas aguijones; y su poder era de hacer daño á los hombres cinco meses.
Y tienen sobre sí por rey al ángel del abismo, cuyo nombre en hebraico es Abaddon, y en griego, Apollyon.
El primer ¡Ay! es pasado: he aquí, vienen aún dos ayes después de estas cosas.
Y el sexto ángel tocó la trompeta; y oí una voz de los cuatro cuernos del altar de oro que estaba delante de Dios,
Diciendo al sexto ángel que tenía la trompeta: Desata los cuatro ángeles que están atados en el gran río Eufrates.
Y fueron desatados los cuatro ángeles que estaban aparejados para la hora y día y mes y año, para matar la tercera parte de los hombres.
Y el número del ejército de los de á caballo era doscientos millones. Y oí el número de ellos.
De estas tres plagas fué muerta la tercera parte de los hombres: del fuego, y del humo, y del azufre, que salían de la boca de ellos.
Porque su poder está en su boca y en sus colas: porque sus colas eran semejantes á serpientes, y tenían cabezas, y con ellas dañan.
Y no se arrepintieron de sus homicidios, ni de sus hechicerías, ni de su fornicación, ni de sus hurtos.
Y VI otro ángel fuerte descender del cielo, cercado de una nube, y el arco celeste sobre su cabeza; y su rostro era como el sol, y sus pies como columnas de fuego.
Y tenía en su mano un librito abierto: y puso su pie derecho sobre el mar, y el izquierdo sobre la tierra;
Y clamó con grande voz, comocuandoun león ruge: y cuando hubo clamado, siete truenos hablaron sus voces.
Y cuando los siete truenos hubieron hablado sus voces, yo iba á escribir, y oí una voz del cielo que me decía: Sella las cosas que los siete truenos han hablado, y no las escribas.
Y el ángel que vi estar sobre el mar y sobre la tierra, levantó su mano al cielo,
Pero en los días de la voz del séptimo ángel, cuando él comenzare á tocar la trompeta, el misterio de Dios será consumado, como él lo anunció á sus siervos los profetas.
Y la voz que oí del cielo hablaba otra vez conmigo, y decía: Ve, y toma el librito abierto de la mano del ángel que está sobre el mar y sobre la tierra.
Y fuí al ángel, diciéndole que me diese el librito, y él me dijo: Toma, y trágalo; y él te hará amargar tu vientre, pero en tu boca será dulce como la miel.
Y tomé el librito de la mano del ángel, y lo devoré; y era dulce en mi boca como la miel; y cuando lo hube devorado, fué amargo mi vientre.
Y él me dice: Necesario es que otra vez profetices á muchos pueblos y gentes y lenguas y reyes.
Y ME fué dada una caña semejante á una vara, y se me dijo: Levántate, y mide el templo de Dios, y el altar, y á los que adoran en él.
Y echa fuera el patio que está fuera del templo, y no lo midas, porque es dado á los Gentiles; y hollarán la ciudad santa cuarenta y dos meses.
Y daré á mis dos testigos, y ellos profetizarán por mil doscientos y sesenta días, vestidos de sacos.
Estas son las dos olivas, y los dos candeleros que están delante del Dios de la tierra.
Y si alguno les quisiere dañar, sale fuego de la boca de ellos, y devora á sus enemigos: y si alguno les quisiere hacer daño, es necesario que él sea así muerto.
Y cuando ellos hubieren acabado su testimonio, la bestia que sube del abismo hará guerra contra ellos, y los vencerá, y los matará.
Y sus cuerpos serán echados en las plazas de la grande ciudad, que espiritualmente es llamada Sodoma y Egipto, donde también nuestro Señor fué crucificado.
Y los de los linajes, y de los pueblos, y de las lenguas, y de los Gentiles verán los cuerpos de ellos por tres días y medio, y no permitirán que sus cuerpos sean puestos en sepulcros.
Y los moradores de la tierra se gozarán sobre ellos, y se alegrarán, y se enviarán dones los unos á los otros; porque estos dos profetas han atormentado á los que moran sobre la tierra.
Y después de tres días y medio el espíritu de vida enviado de Dios, entró en ellos, y se alzaron sobre sus pies, y vino gran temor sobre los que los vieron.
Y oyeron una grande voz del cielo, que les decía: Subid acá. Y subieron al cielo en una nube, y sus enemigos los vieron.
El segundo ¡Ay! es pasado: he aquí, el tercer ¡Ay! vendrá presto.
Y los veinticuatro ancianos que estaban sentados delante de Dios en sus sillas, se postraron sobre sus rostros, y adoraron á Dios,
Diciendo: Te damos gracias, Señor Dios Todopoderoso, que eres y que eras y que has de venir, porque has tomado tu grande potencia, y has reinado.
Y el templo de Dios fué abierto en el cielo, y el arca de su testamento fué vista en su templo. Y fueron hechos relámpagos y voces y truenos y terremotos y grande granizo.
Y UNA grande señal apareció en el cielo: una mujer vestida del sol, y la luna debajo de sus pies, y sobre su cabeza una corona de doce estrellas.
Y estando preñada, clamaba con dolores de parto, y sufría tormento por parir.
Y fué vista otra señal en el cielo: y he aquí un grande dragón bermejo, que tenía siete cabezas y diez cuernos, y en sus cabezas siete diademas.
Y su cola arrastraba la tercera parte de las estrellas del cielo, y las echó en tierra. Y el dragón se paró delante de la mujer que estaba para parir, á fin de devorar á su hijo cuando hubiese parido.
Y ella parió un hijo varón, el cual había de regir todas las gentes con vara de hierro: y su hijo fué arrebatado para Dios y á su trono.
Y la mujer huyó al desierto, donde tiene lugar aparejado de Dios, para que allí la mantengan mil doscientos y sesenta días.
Y fué hecha una grande batalla en el cielo: Miguel y sus ángeles lidiaban contra el dragón; y lidiaba el dragón y sus ángeles,
Y no prevalecieron, ni su lugar fué más hallado en el cielo.
Y fué lanzado fuera aquel gran dragón, la serpiente antigua, que se llama Diablo y Satanás, el cual engaña á todo el mundo; fué arrojado en tierra, y sus ángeles fueron arrojados con él.
Y ellos le han vencido por la sangre del Cordero, y por la palabra de su testimonio; y no han amado sus vidas hasta la muerte.
Por lo cual alegraos, cielos, y los que moráis en ellos. ¡Ay de los moradores de la tierra y del mar! porque el diablo ha descendido á vosotros, teniendo grande ira, sabiendo que tiene poco tiempo.
Y cuando vió el dragón que él había sido arrojado á la tierra, persiguió á la mujer que había parido al hijo varón.
Y la serpiente echó de su boca tras la mujer agua como un río, á fin de hacer que fuese arrebatada del río.
Y la tierra ayudó á la mujer, y la tierra abrió su boca, y sorbió el río que había echado el dragón de su boca.
Entonces el dragón fué airado contra la mujer; y se fué á hacer guerra contra los otros de la simiente de ella, los cuales guardan los mandamientos de Dios, y tienen el testimonio de Jesucristo.
Y YO me paré sobre la arena del mar, y vi una bestia subir del mar, que tenía siete cabezas y diez cuernos; y sobre sus cuernos diez diademas; y sobre las cabezas de ella nombre de blasfemia.
Y la bestia que vi, era semejante á un leopardo, y sus pies como de oso, y su boca como boca de león. Y el dragón le dió su poder, y su trono, y grande potestad.
Y vi una de sus cabezas como herida de muerte, y la llaga de su muerte fué curada: y se maravilló toda la tierra en pos de la bestia.
Y adoraron al dragón que había dado la potestad á la bestia, y adoraron á la bestia, diciendo: ¿Quién es semejante á la bestia, y quién podrá lidiar con ella?
Y le fué dada boca que hablaba grandes cosas y blasfemias: y le fué dada potencia de obrar cuarenta y dos meses.
Y abrió su boca en blasfemias contra Dios, para blasfemar su nombre, y su tabernáculo, y á los que moran en el cielo.
Y le fué dado hacer guerra contra los santos, y vencerlos. También le fué dada potencia sobre toda tribu y pueblo y lengua y gente.
Y todos los que moran en la tierra le adoraron, cuyos nombres no están escritos en el libro de la vida del Cordero, el cual fué muerto desde el principio del mundo.
Si alguno tiene oído, oiga.
El que lleva en cautividad, va en cautividad: el que á cuchillo matare, es necesario que á cuchillo sea muerto. Aquí está la paciencia y la fe de los santos.
Después vi otra bestia que subía de la tierra; y tenía dos cuernos semejantes á los de un cordero, mas hablaba como un dragón.
Y ejerce todo el poder de la primera bestia en presencia de ella; y hace á la tierra y á los moradores de ella adorar la primera bestia, cuya llaga de muerte fué curada.
Y hace grandes señales, de tal manera que aun hace descender fuego del cielo á la tierra delante de los hombres.
Y le fué dado que diese espíritu á la imagen de la bestia, para que la imagen de la bestia hable; y hará que cualesquiera que no adoraren la imagen de la bestia sean muertos.
Y hacía que á todos, á los pequeños y grandes, ricos y pobres, libres y siervos, se pusiese una marca en su mano derecha, ó en sus frentes:
Y que ninguno pudiese comprar ó vender, sino el que tuviera la señal, ó el nombre de la bestia, ó el número de su nombre.
Aquí hay sabiduría. El que tiene entendimiento, cuente el número de la bestia; porque es el número de hombre: y el número de ella, seiscientos sesenta y seis.
Y MIRÉ, y he aquí, el Cordero estaba sobre el monte de Sión, y con él ciento cuarenta y cuatro mil, que tenían el nombre de su Padre escrito en sus frentes.
Y oí una voz del cielo como ruido de muchas aguas, y como sonido de un gran trueno: y oí una voz de tañedores de arpas que tañían con sus arpas:
Y en sus bocas no ha sido hallado engaño; porque ellos son sin mácula delante del trono de Dios.
Y vi otro ángel volar por en medio del cielo, que tenía el evangelio eterno para predicarlo á los que moran en la tierra, y á toda nación y tribu y lengua y pueblo,
Diciendo en alta voz: Temed á Dios, y dadle honra; porque la hora de su juicio es venida; y adorad á aquel que ha hecho el cielo y la tierra y el mar y las fuentes de las aguas.
Y otro ángel le siguió, diciendo: Ha caído, ha caído Babilonia, aquella grande ciudad, porque ella ha dado á beber á todas las naciones del vino del furor de su fornicación.
Y el tercer ángel los siguió, diciendo en alta voz: Si alguno adora á la bestia y á su imagen, y toma la señal en su frente, ó en su mano,
Y el humo del tormento de ellos sube para siempre jamás. Y los que adoran á la bestia y á su imagen, no tienen reposo día ni noche, ni cualquiera que tomare la señal de su nombre.
Aquí está la paciencia de los santos; aquí están los que guardan los mandamientos de Dios, y la fe de Jesús.
Y miré, y he aquí una nube blanca; y sobre la nube uno sentado semejante al Hijo del hombre, que tenía en su cabeza una corona de oro, y en su mano una hoz aguda.
Y otro ángel salió del templo, clamando en alta voz al que estaba sentado sobre la nube: Mete tu hoz, y siega; porque la hora de segar te es venida, porque la mies de la tierra está madura.
Y el que estaba sentado sobre la nube echó su hoz sobre la tierra, y la tierra fué segada.
Y salió otro ángel del templo que está en el cielo, teniendo también una hoz aguda.
Y el ángel echó su hoz aguda en la tierra, y vendimió la viña de la tierra, y echó la uva en el grande lagar de la ira de Dios.
Y el lagar fué hollado fuera de la ciudad, y del lagar salió sangre hasta los frenos de los caballos por mil y seiscientos estadios.
Y VI otra señal en el cielo, grande y admirable, que era siete ángeles que tenían las siete plagas postreras; porque en ellas es consumada la ira de Dios.
¿Quién no te temerá, oh Señor, y engrandecerá tu nombre? porque tú sólo eres santo; por lo cual todas las naciones vendrán, y adorarán delante de ti, porque tus juicios son manifestados.
Y después de estas cosas miré, y he aquí el templo del tabernáculo del testimonio fué abierto en el cielo;
Y salieron del templo siete ángeles, que tenían siete plagas, vestidos de un lino limpio y blanco, y ceñidos alrededor de los pechos con bandas de oro.
Y uno de los cuatro animales dió á los siete ángeles siete copas de oro, llenas de la ira de Dios, que vive para siempre jamás.
Y fué el templo lleno de humo por la majestad de Dios, y por su potencia; y ninguno podía entrar en el templo, hasta que fuesen consumadas las siete plagas de los siete ángeles.
Y OÍ una gran voz del templo, que decía á los siete ángeles: Id, y derramad las siete copas de la ira de Dios sobre la tierra.
Y fué el primero, y derramó su copa sobre la tierra; y vino una plaga mala y dañosa sobre los hombres que tenían la señal de la bestia, y sobre los que adoraban su imagen.
Y el segundo ángel derramó su copa sobre el mar, y se convirtió en sangre como de un muerto; y toda alma viviente fué muerta en el mar.
Y el tercer ángel derramó su copa sobre los ríos, y sobre las fuentes de las aguas, y se convirtieron en sangre.
Y oí al ángel de las aguas, que decía: Justo eres tú, oh Señor, que eres y que eras, el Santo, porque has juzgado estas cosas:
Porque ellos derramaron la sangre de los santos y de los profetas, también tú les has dado á beber sangre; pues lo merecen.
Y oí á otro del altar, que decía: Ciertamente, Señor Dios Todopoderoso, tus juicios son verdaderos y justos.
Y el cuarto ángel derramó su copa sobre el sol; y le fué dado quemar á los hombres con fuego.
Y los hombres se quemaron con el grande calor, y blasfemaron el nombre de Dios, que tiene potestad sobre estas plagas, y no se arrepintieron para darle gloria.
Y el quinto ángel derramó su copa sobre la silla de la bestia; y su reino se hizo tenebroso, y se mordían sus lenguas de dolor;
Y blasfemaron del Dios del cielo por sus dolores, y por sus plagas, y no se arrepintieron de sus obras.
Y el sexto ángel derramó su copa sobre el gran río Eufrates; y el agua de él se secó, para que fuese preparado el camino de los reyes del Oriente.
Y vi salir de la boca del dragón, y de la boca de la bestia, y de la boca del falso profeta, tres espíritus inmundos á manera de ranas:
Porque son espíritus de demonios, que hacen señales, para ir á los reyes de la tierra y de todo el mundo, para congregarlos para la batalla de aquel gran día del Dios Todopoderoso.
He aquí, yo vengo como ladrón. Bienaventurado el que vela, y guarda sus vestiduras, para que no ande desnudo, y vean su vergüenza.
Y los congregó en el lugar que en hebreo se llama Armagedón.
Y el séptimo ángel derramó su copa por el aire; y salió una grande voz del templo del cielo, del trono, diciendo: Hecho es.
Entonces fueron hechos relámpagos y voces y truenos; y hubo un gran temblor de tierra, un terremoto tan grande, cual no fué jamás desde que los hombres han estado sobre la tierra.
Y toda isla huyó, y los montes no fueron hallados.
Y cayó del cielo sobre los hombres un grande granizo como del peso de un talento: y los hombres blasfemaron de Dios por la plaga del granizo; porque su plaga fué muy grande.
Y VINO uno de los siete ángeles que tenían las siete copas, y habló conmigo, diciéndome: Ven acá, y te mostraré la condenación de la grande ramera, la cual está sentada sobre muchas aguas:
Con la cual han fornicado los reyes de la tierra, y los que moran en la tierra se han embriagado con el vino de su fornicación.
Y me llevó en Espíritu al desierto; y vi una mujer sentada sobre una bestia bermeja llena de nombres de blasfemia y que tenía siete cabezas y diez cuernos.
Y en su frente un nombre escrito: MISTERIO, BABILONIA LA GRANDE, LA MADRE DE LAS FORNICACIONES Y DE LAS ABOMINACIONES DE LA TIERRA.
Y vi la mujer embriagada de la sangre de los santos, y de la sangre de los mártires de Jesús: y cuando la vi, quedé maravillado de grande admiración.
Y el ángel me dijo: ¿Por qué te maravillas? Yo te diré el misterio de la mujer, y de la bestia que la trae, la cual tiene siete cabezas y diez cuernos.
Y aquí hay mente que tiene sabiduría. Las siete cabezas son siete montes, sobre los cuales se asienta la mujer.
Y son siete reyes. Los cinco son caídos; el uno es, el otro aun no es venido; y cuando viniere, es necesario que dure breve tiempo.
Y la bestia que era, y no es, es también el octavo, y es de los siete, y va á perdición.
Y los diez cuernos que has visto, son diez reyes, que aun no han recibido reino; mas tomarán potencia por una hora como reyes con la bestia.
Estos tienen un consejo, y darán su potencia y autoridad á la bestia.
Ellos pelearán contra el Cordero, y el Cordero los vencerá, porque es el Señor de los señores, y el Rey de los reyes: y los que están con él son llamados, y elegidos, y fieles.
Y él me dice: Las aguas que has visto donde la ramera se sienta, son pueblos y muchedumbres y naciones y lenguas.
Y los diez cuernos que viste en la bestia, éstos aborrecerán á la ramera, y la harán desolada y desnuda: y comerán sus carnes, y la quemarán con fuego:
Porque Dios ha puesto en sus corazones ejecutar lo que le plugo, y el ponerse de acuerdo, y dar su reino á la bestia, hasta que sean cumplidas las palabras de Dios.
Y la mujer que has visto, es la grande ciudad que tiene reino sobre los reyes de la tierra.
Y DESPUÉS de estas cosas vi otro ángel descender del cielo teniendo grande potencia; y la tierra fué alumbrada de su gloria.
Y oí otra voz del cielo, que decía: Salid de ella, pueblo mío, porque no seáis participantes de sus pecados, y que no recibáis de sus plagas;
Porque sus pecados han llegado hasta el cielo, y Dios se ha acordado de sus maldades.
Tornadle á dar como ella os ha dado, y pagadle al doble según sus obras; en el cáliz que ella os dió á beber, dadle á beber doblado.
Cuanto ella se ha glorificado, y ha estado en deleites, tanto dadle de tormento y llanto; porque dice en su corazón: Yo estoy sentada reina, y no soy viuda, y no veré llanto.
Por lo cual en un día vendrán sus plagas, muerte, llanto y hambre, y será quemada con fuego; porque el Señor Dios es fuerte, que la juzgará.
Y llorarán y se lamentarán sobre ella los reyes de la tierra, los cuales han fornicado con ella y han vivido en deleites, cuando ellos vieren el humo de su incendio,
Estando lejos por el temor de su tormento, diciendo: ¡Ay, ay, de aquella gran ciudad de Babilonia, aquella fuerte ciudad; porque en una hora vino tu juicio!
Y los mercaderes de la tierra lloran y se lamentan sobre ella, porque ninguno compra más sus mercaderías:
Y canela, y olores, y ungüentos, y de incienso, y de vino, y de aceite; y flor de harina y trigo, y de bestias, y de ovejas; y de caballos, y de carros, y de siervos, y de almas de hombres.
Y los frutos del deseo de tu alma se apartaron de ti; y todas las cosas gruesas y excelentes te han faltado, y nunca más las hallarás.
Los mercaderes de estas cosas, que se han enriquecido, se pondrán lejos de ella por el temor de su tormento, llorando y lamentando,
Y diciendo: ¡Ay, ay, aquella gran ciudad, que estaba vestida de lino fino, y de escarlata, y de grana, y estaba dorada con oro, y adornada de piedras preciosas y de perlas!
Porque en una hora han sido desoladas tantas riquezas. Y todo patrón, y todos los que viajan en naves, y marineros, y todos los que trabajan en el mar, se estuvieron lejos;
Y viendo el humo de su incendio, dieron voces, diciendo: ¿Qué ciudad era semejante á esta gran ciudad?
Alégrate sobre ella, cielo, y vosotros, santos, apóstoles, y profetas; porque Dios ha vengado vuestra causa en ella.
Y un ángel fuerte tomó una piedra como una grande piedra de molino, y la echó en la mar, diciendo: Con tanto ímpetu será derribada Babilonia, aquella grande ciudad, y nunca jamás será hallada.
Y en ella fué hallada la sangre de los profetas y de los santos, y de todos los que han sido muertos en la tierra.
DESPUÉS de estas cosas oí una gran voz de gran compañía en el cielo, que decía: Aleluya: Salvación y honra y gloria y potencia al Señor Dios nuestro.
Porque sus juicios son verdaderos y justos; porque él ha juzgado á la grande ramera, que ha corrompido la tierra con su fornicación, y ha vengado la sangre de sus siervos de la mano de ella.
Y otra vez dijeron: Aleluya. Y su humo subió para siempre jamás.
Y los veinticuatro ancianos y los cuatro animales se postraron en tierra, y adoraron á Dios que estaba sentado sobre el trono, diciendo: Amén: Aleluya.
Y salió una voz del trono, que decía: Load á nuestro Dios todos sus siervos, y los que le teméis, así pequeños como grandes.
Y oí como la voz de una grande compañía, y como el ruido de muchas aguas, y como la voz de grandes truenos, que decía: Aleluya: porque reinó el Señor nuestro Dios Todopoderoso.
Gocémonos y alegrémonos y démosle gloria; porque son venidas las bodas del Cordero, y su esposa se ha aparejado.
Y le fué dado que se vista de lino fino, limpio y brillante: porque el lino fino son las justificaciones de los santos.
Y él me dice: Escribe: Bienaventurados los que son llamados á la cena del Cordero. Y me dijo: Estas palabras de Dios son verdaderas.
Y vi el cielo abierto; y he aquí un caballo blanco, y el que estaba sentado sobre él, era llamado Fiel y Verdadero, el cual con justicia juzga y pelea.
Y sus ojos eran como llama de fuego, y había en su cabeza muchas diademas; y tenía un nombre escrito que ninguno entendía sino él mismo.
Y estaba vestido de una ropa teñida en sangre: y su nombre es llamado EL VERBO DE DIOS.
Y los ejércitos que están en el cielo le seguían en caballos blancos, vestidos de lino finísimo, blanco y limpio.
Y en su vestidura y en su muslo tiene escrito este nombre: REY DE REYES Y SEÑOR DE SEÑORES.
Y vi un ángel que estaba en el sol, y clamó con gran voz, diciendo á todas las aves que volaban por medio del cielo: Venid, y congregaos á la cena del gran Dios,
Y vi la bestia, y los reyes de la tierra y sus ejércitos, congregados para hacer guerra contra el que estaba sentado sobre el caballo, y contra su ejército.
Y los otros fueron muertos con la espada que salía de la boca del que estaba sentado sobre el caballo, y todas las aves fueron hartas de las carnes de ellos.
Y VI un ángel descender del cielo, que tenía la llave del abismo, y una grande cadena en su mano.
Y prendió al dragón, aquella serpiente antigua, que es el Diablo y Satanás, y le ató por mil años;
Y arrojólo al abismo, y le encerró, y selló sobre él, porque no engañe más á las naciones, hasta que mil años sean cumplidos: y después de esto es necesario que sea desatado un poco de tiempo.
Mas los otros muertos no tornaron á vivir hasta que sean cumplidos mil años. Esta es la primera resurrección.
Bienaventurado y santo el que tiene parte en la primera resurrección: la segunda muerte no tiene potestad en éstos; antes serán sacerdotes de Dios y de Cristo, y reinarán con él mil años.
Y cuando los mil años fueren cumplidos, Satanás será suelto de su prisión,
Y saldrá para engañar las naciones que están sobre los cuatro ángulos de la tierra, á Gog y á Magog, á fin de congregarlos para la batalla; el número de los cuales es como la arena del mar.
Y subieron sobre la anchura de la tierra, y circundaron el campo de los santos, y la ciudad amada: y de Dios descendió fuego del cielo, y los devoró.
Y el diablo que los engañaba, fué lanzado en el lago de fuego y azufre, donde está la bestia y el falso profeta; y serán atormentados día y noche para siempre jamás.
Y vi un gran trono blanco y al que estaba sentado sobre él, de delante del cual huyó la tierra y el cielo; y no fué hallado el lugar de ellos.
Y el mar dió los muertos que estaban en él; y la muerte y el infierno dieron los muertos que estaban en ellos; y fué hecho juicio de cada uno según sus obras.
Y el infierno y la muerte fueron lanzados en el lago de fuego. Esta es la muerte segunda.
Y el que no fué hallado escrito en el libro de la vida, fué lanzado en el lago de fuego.
Y VI un cielo nuevo, y una tierra nueva: porque el primer cielo y la primera tierra se fueron, y el mar ya no es.
Y yo Juan vi la santa ciudad, Jerusalem nueva, que descendía del cielo, de Dios, dispuesta como una esposa ataviada para su marido.
Y oí una gran voz del cielo que decía: He aquí el tabernáculo de Dios con los hombres, y morará con ellos; y ellos serán su pueblo, y el mismo Dios será su Dios con ellos.
Y limpiará Dios toda lágrima de los ojos de ellos; y la muerte no será más; y no habrá más llanto, ni clamor, ni dolor: porque las primeras cosas son pasadas.
Y el que estaba sentado en el trono dijo: He aquí, yo hago nuevas todas las cosas. Y me dijo: Escribe; porque estas palabras son fieles y verdaderas.
Y díjome: Hecho es. Yo soy Alpha y Omega, el principio y el fin. Al que tuviere sed, yo le daré de la fuente del agua de vida gratuitamente.
El que venciere, poseerá todas las cosas; y yo seré su Dios, y él será mi hijo.
Y vino á mí uno de los siete ángeles que tenían las siete copas llenas de las siete postreras plagas, y habló conmigo, diciendo: Ven acá, yo te mostraré la esposa, mujer del Cordero.
Y llevóme en Espíritu á un grande y alto monte, y me mostró la grande ciudad santa de Jerusalem, que descendía del cielo de Dios,
Teniendo la claridad de Dios: y su luz era semejante á una piedra preciosísima, como piedra de jaspe, resplandeciente como cristal.
Y tenía un muro grande y alto con doce puertas; y en las puertas, doce ángeles, y nombres escritos, que son los de las doce tribus de los hijos de Israel.
Al oriente tres puertas; al norte tres puertas; al mediodía tres puertas; al poniente tres puertas.
Y el muro de la ciudad tenía doce fundamentos, y en ellos los doce nombres de los doce apóstoles del Cordero.
Y el que hablaba conmigo, tenía una medida de una caña de oro para medir la ciudad, y sus puertas, y su muro.
Y la ciudad está situada y puesta en cuadro, y su largura es tanta como su anchura: y él midió la ciudad con la caña, doce mil estadios: la largura y la altura y la anchura de ella son iguales.
Y midió su muro, ciento cuarenta y cuatro codos, de medida de hombre, la cual es del ángel.
Y el material de su muro era de jaspe: mas la ciudad era de oro puro, semejante al vidrio limpio.
Y los fundamentos del muro de la ciudad estaban adornados de toda piedra preciosa. El primer fundamento era jaspe; el segundo, zafiro; el tercero, calcedonia; el cuarto, esmeralda;
El quinto, sardónica; el sexto, sardio; el séptimo, crisólito; el octavo, berilo; el nono, topacio; el décimo, crisopraso; el undécimo, jacinto; el duodécimo, amatista.
Y las doce puertas eran doce perlas, en cada una, una; cada puerta era de una perla. Y la plaza de la ciudad era de oro puro como vidrio trasparente.
Y no vi en ella templo; porque el Señor Dios Todopoderoso es el templo de ella, y el Cordero.
Y la ciudad no tenía necesidad de sol, ni de luna, para que resplandezcan en ella: porque la claridad de Dios la iluminó, y el Cordero era su lumbrera.
Y las naciones que hubieren sido salvas andarán en la lumbre de ella: y los reyes de la tierra traerán su gloria y honor á ella.
Y sus puertas nunca serán cerradas de día, porque allí no habrá noche.
Y llevarán la gloria y la honra de las naciones á ella.
No entrará en ella ninguna cosa sucia, ó que hace abominación y mentira; sino solamente los que están escritos en el libro de la vida del Cordero.
DESPUÉS me mostró un río limpio de agua de vida, resplandeciente como cristal, que salía del trono de Dios y del Cordero.
Y no habrá más maldición; sino que el trono de Dios y del Cordero estará en ella, y sus siervos le servirán.
Y verán su cara; y su nombre estará en sus frentes.
Y allí no habrá más noche; y no tienen necesidad de lumbre de antorcha, ni de lumbre de sol: porque el Señor Dios los alumbrará: y reinarán para siempre jamás.
Y me dijo: Estas palabras son fieles y verdaderas. Y el Señor Dios de los santos profetas ha enviado su ángel, para mostrar á sus siervos las cosas que es necesario que sean hechas presto.
Y he aquí, vengo presto. Bienaventurado el que guarda las palabras de la profecía de este libro.
Yo Juan soy el que ha oído y visto estas cosas. Y después que hube oído y visto, me postré para adorar delante de los pies del ángel que me mostraba estas cosas.
Y él me dijo: Mira que no lo hagas: porque yo soy siervo contigo, y con tus hermanos los profetas, y con los que guardan las palabras de este libro. Adora á Dios.
Y me dijo: No selles las palabras de la profecía de este libro; porque el tiempo está cerca.
El que es injusto, sea injusto todavía: y el que es sucio, ensúciese todavía: y el que es justo, sea todavía justificado: y el santo sea santificado todavía.
Y he aquí, yo vengo presto, y mi galardón conmigo, para recompensar á cada uno según fuere su obra.
Yo soy Alpha y Omega, principio y fin, el primero y el postrero.
Bienaventurados los que guardan sus mandamientos, para que su potencia sea en el árbol de la vida, y que entren por las puertas en la ciudad.
Mas los perros estarán fuera, y los hechiceros, y los disolutos, y los homicidas, y los idólatras, y cualquiera que ama y hace mentira.
Yo Jesús he enviado mi ángel para daros testimonio de estas cosas en las iglesias. Yo soy la raíz y el linaje de David, la estrella resplandeciente, y de la mañana.
Y el Espíritu y la Esposa dicen: Ven. Y el que oye, diga: Ven. Y el que tiene sed, venga: y el que quiere, tome del agua de la vida de balde.
Porque yo protesto á cualquiera que oye las palabras de la profecía de este libro: Si alguno añadiere á estas cosas, Dios pondrá sobre él las plagas que están escritas en este libro.
Y si alguno quitare de las palabras del libro de esta profecía, Dios quitará su parte del libro de la vida, y de la santa ciudad, y de las cosas que están escritas en este libro.
El que da testimonio de estas cosas, dice: Ciertamente, vengo en breve. Amén, sea así. Ven, Señor Jesús.
